"""LocalSGD on 2 CPU ranks: parameters drift apart between averagings and agree after each."""

from __future__ import annotations

import pytest

from notebook_launcher import notebook_launcher

pytestmark = pytest.mark.multiprocess


def _train() -> list[tuple[int, float]]:
    import torch

    from notebook_launcher import Accelerator
    from notebook_launcher.local_sgd import LocalSGD
    from notebook_launcher.utils import gather

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.full((8, 4), float(accelerator.process_index + 1))  # each rank its own data
    spread = []

    def disagreement() -> float:
        weights = gather(accelerator.unwrap_model(model).weight.detach().reshape(1, -1))
        return float((weights[0] - weights[1]).abs().max())

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=3) as local_sgd:
        for step in range(1, 6):
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            spread.append((step, disagreement()))
    spread.append((0, disagreement()))  # after the block: averaged once more
    return spread


@pytest.mark.timeout(120)
def test_local_sgd_averages_every_n_steps_and_on_exit() -> None:
    spread = notebook_launcher(_train, num_processes=2, dashboard=False)[0]
    by_step = dict(spread)
    assert by_step[1] > 0 and by_step[2] > 0 and by_step[4] > 0  # no gradient all-reduce
    assert by_step[3] == 0  # averaged at the 3rd step
    assert by_step[0] == 0  # and when the block ends
