"""A model on a device (the cpu case everywhere, the cuda case on a machine with a CUDA GPU):
a tfl.EmbeddingTable's rows stay in host memory, the batch's rows come to the device for the
lookup and their gradient leaves it as rows (the table trains exactly as an
nn.Embedding(sparse=True) with torch's SGD); a checkpoint written on the CPU loads into a
model on the device with tfl.load_checkpoint, the values landing on the model's device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]
ROWS, DIM, CLASSES, BATCH, STEPS = 30, 4, 3, 8, 5

pytestmark = pytest.mark.timeout(60)


class TableModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table = tfl.EmbeddingTable(
            ROWS, DIM, initializer=tfl.RowInitializer("normal", 1.0, seed=5)
        )
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.table(ids).mean(1))


def _batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, ROWS, (BATCH, 3), generator=generator).to(device),
            torch.randint(0, CLASSES, (BATCH,), generator=generator).to(device),
        )
        for _ in range(STEPS)
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_table_rows_come_to_the_device_and_train_like_a_sparse_embedding(device: str) -> None:
    where = torch.device(device)
    model = TableModel().to(where)
    with tfl.TrainingSession(None, model, optimizer=tfl.optim.SGD(lr=0.1)) as sess:
        with torch.no_grad():
            initial = model.table(torch.arange(ROWS, device=where)).cpu()
        assert model.table(torch.arange(3, device=where)).device.type == device  # on the device
        reference = nn.Embedding.from_pretrained(initial.clone(), freeze=False, sparse=True)
        head = nn.Linear(DIM, CLASSES)
        head.load_state_dict({k: v.cpu() for k, v in model.out.state_dict().items()})
        optimizer = torch.optim.SGD([*reference.parameters(), *head.parameters()], lr=0.1)
        for ids, labels in _batches(where):
            sess.step(lambda ids=ids, labels=labels: F.cross_entropy(sess.model(ids), labels))
            optimizer.zero_grad()
            F.cross_entropy(head(reference(ids.cpu()).mean(1)), labels.cpu()).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            rows = model.table(torch.arange(ROWS, device=where))
    assert rows.device.type == device
    assert (rows.cpu() - initial).abs().max() > 1e-3  # the rows trained
    assert torch.allclose(rows.cpu(), reference.weight.detach(), atol=1e-5)
    assert torch.allclose(model.out.weight.cpu(), head.weight.detach(), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_cpu_checkpoint_loads_onto_the_models_device(tmp_path: Path, device: str) -> None:
    torch.manual_seed(0)
    trained = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with tfl.TrainingSession(
        None, trained, optimizer=tfl.optim.SGD(lr=0.1), checkpoint_dir=str(tmp_path)
    ) as sess:
        for step in range(3):
            x = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
            sess.step(lambda x=x: sess.model(x).square().mean())
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(device)
    state = tfl.load_checkpoint(tmp_path, model)
    for name, value in model.state_dict().items():
        assert value.device.type == device, name
        assert torch.equal(value.cpu(), trained.state_dict()[name]), name
        assert torch.equal(state[name], trained.state_dict()[name]), name
    assert int(model[1].num_batches_tracked) == 3
