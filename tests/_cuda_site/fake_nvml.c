/* A stand-in for NVIDIA's management library (libnvidia-ml.so.1), for the CUDA emulation tier
 * (tests/_cuda_site/cuda_emulation.py): a pretend GPU machine, asked through the same C entry
 * points as the real library, by torch (torch/cuda/__init__.py: _raw_device_count_nvml,
 * _raw_device_uuid_nvml) and by notebook_launcher (_placement._nvml_devices).
 *
 * NL_FAKE_GPUS       how many GPUs (default 2)
 * NL_FAKE_GPU_NAME   their name (default "NVIDIA H100 80GB HBM3")
 * NL_FAKE_GPU_CAP    their compute capability, "9.0" (default)
 * NL_FAKE_NVML_FAULT what goes wrong, to test how a caller copes with a broken driver:
 *                    "crash" (SIGSEGV in nvmlDeviceGetCount), "huge" (a count of 100,000,000),
 *                    "badutf8" (UUIDs and names that are not UTF-8), "initfail"
 *                    (nvmlInit says the driver is not loaded), "mig" (MIG mode on GPU 0)
 * Built with -DNO_MIG_MODE it lacks nvmlDeviceGetMigMode, as drivers before R450 do.
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

static const char *fault(void) {
    const char *f = getenv("NL_FAKE_NVML_FAULT");
    return f ? f : "";
}

static unsigned count(void) {
    const char *n = getenv("NL_FAKE_GPUS");
    return n ? (unsigned)strtoul(n, NULL, 10) : 2u;
}

static int index_of(void *handle) { return (int)(intptr_t)handle - 1; }

int nvmlInit_v2(void) { return strcmp(fault(), "initfail") == 0 ? 9 /* DRIVER_NOT_LOADED */ : 0; }
int nvmlInit(void) { return nvmlInit_v2(); }
int nvmlShutdown(void) { return 0; }

int nvmlDeviceGetCount_v2(unsigned *out) {
    if (strcmp(fault(), "crash") == 0)
        raise(SIGSEGV);
    *out = strcmp(fault(), "huge") == 0 ? 100000000u : count();
    return 0;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **handle) {
    *handle = (void *)(intptr_t)(index + 1);
    return 0;
}

int nvmlDeviceGetName(void *handle, char *name, unsigned length) {
    const char *n = getenv("NL_FAKE_GPU_NAME");
    if (strcmp(fault(), "badutf8") == 0)
        snprintf(name, length, "NVIDIA \xff\xfe GPU");
    else
        snprintf(name, length, "%s", n ? n : "NVIDIA H100 80GB HBM3");
    (void)handle;
    return 0;
}

int nvmlDeviceGetUUID(void *handle, char *uuid, unsigned length) {
    if (strcmp(fault(), "badutf8") == 0)
        snprintf(uuid, length, "GPU-\xff%07d", index_of(handle));
    else
        snprintf(uuid, length, "GPU-%08d-1111-2222-3333-444455556666", index_of(handle));
    return 0;
}

int nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *memory) {
    (void)handle;
    memory->total = 80ull << 30;
    memory->free = memory->total - (512ull << 20);
    memory->used = 512ull << 20;
    return 0;
}

int nvmlDeviceGetCudaComputeCapability(void *handle, int *major, int *minor) {
    const char *cap = getenv("NL_FAKE_GPU_CAP");
    (void)handle;
    *major = 9;
    *minor = 0;
    if (cap)
        sscanf(cap, "%d.%d", major, minor);
    return 0;
}

#ifndef NO_MIG_MODE
int nvmlDeviceGetMigMode(void *handle, unsigned *current, unsigned *pending) {
    *current = *pending = (strcmp(fault(), "mig") == 0 && index_of(handle) == 0) ? 1u : 0u;
    return 0;
}
#endif
