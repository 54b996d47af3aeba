/* A stand-in for the CUDA driver (libcuda.so.1), for the CUDA emulation tier
 * (tests/_cuda_site/cuda_emulation.py). It keeps the one rule of the real driver that a
 * launcher must respect: a process forked after its parent initialised the driver (cuInit)
 * cannot use it -- its cuInit fails, as CUDA's does in such a child ("initialization error").
 * notebook_launcher asks it the way it asks the real one (_placement.driver_initialized:
 * dlopen with RTLD_NOLOAD, then cuDeviceGetCount, which answers CUDA_ERROR_NOT_INITIALIZED
 * before cuInit and initialises nothing).
 */
#include <stdlib.h>
#include <unistd.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_INITIALIZED 3

static pid_t initialised_in = 0; /* the process that ran cuInit; copied into forked children */

int cuInit(unsigned flags) {
    (void)flags;
    if (initialised_in != 0 && initialised_in != getpid())
        return CUDA_ERROR_NOT_INITIALIZED; /* forked after the parent's cuInit */
    initialised_in = getpid();
    return CUDA_SUCCESS;
}

int cuDeviceGetCount(int *count) {
    const char *n = getenv("NL_FAKE_GPUS");
    if (initialised_in != getpid())
        return CUDA_ERROR_NOT_INITIALIZED;
    *count = n ? atoi(n) : 2;
    return CUDA_SUCCESS;
}

int cuDriverGetVersion(int *version) {
    *version = 13000;
    return CUDA_SUCCESS;
}
