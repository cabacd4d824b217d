"""A RowwiseParallel Linear handed its whole input: a plan that splits an MLP's ``down`` by rows and leaves ``up``,
which makes its input, whole (torch raises in its sharding propagation, naming a width twice the real one).
``make`` is the plain MLP, whose recipe is ``ColwiseParallel()`` on ``up``; ``make_normed`` puts a LayerNorm over
``up``'s whole width between them, so that ``up`` split by columns raises in the norm and the recipe is
``RowwiseParallel(input_layouts=Replicate())`` on ``down``; ``fixed`` is the plan written from the first hint.

Plans that leave a Linear out: ``no_down`` (``up`` by columns, ``down`` whole: handed this rank's part of its input),
and on the gated MLP (``make_gated``: ``down(silu(gate(x)) * up(x))``) ``no_up`` (``up`` whole beside ``gate`` split
by columns) and ``swapped`` (``gate`` and ``up`` by rows, ``down`` by columns). On a small language model
(``make_lm``, ``step_lm``: the loss in the step): ``head_split`` (its head by columns, plain: the loss reads half the
vocabulary), ``ids_split`` (its embedding under ``RowwiseParallel()``, whose default layout takes the ids as a
part of the sequence) and ``ids_by_columns`` (its embedding under ``ColwiseParallel()``: the blocks get half its
features)."""

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self, normed: bool) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64) if normed else nn.Identity()
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(x))))


class Net(nn.Module):
    def __init__(self, normed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(normed) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(16, 64), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def make() -> nn.Module:
    return Net()


def make_gated() -> nn.Module:
    net = Net()
    net.blocks = nn.ModuleList(Gated() for _ in range(2))
    return net


def make_normed() -> nn.Module:
    return Net(normed=True)


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    """Each block's ``down`` by rows, its ``up`` left whole."""
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh["TP"], {"down": RowwiseParallel()})  # type: ignore[index]
    return model


def fixed(model: nn.Module, mesh: object) -> nn.Module:
    """The plan the hint gives: ``up`` by columns too."""
    for block in model.blocks:  # type: ignore[union-attr]
        styles = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(block, mesh["TP"], styles)  # type: ignore[index]
    return model


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(MLP(False) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_lm() -> nn.Module:
    return LM()


def step_lm(model: nn.Module, micro_batch_size: int) -> None:
    ids = torch.randint(0, 32, (micro_batch_size, 9))
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()


def head_split(model: nn.Module, mesh: object) -> nn.Module:
    fixed(model, mesh)
    return parallelize_module(model, mesh["TP"], {"head": ColwiseParallel()})  # type: ignore[index]


def ids_split(model: nn.Module, mesh: object) -> nn.Module:
    fixed(model, mesh)
    return parallelize_module(model, mesh["TP"], {"embed": RowwiseParallel()})  # type: ignore[index]


def ids_by_columns(model: nn.Module, mesh: object) -> nn.Module:
    """The embedding under plain ``ColwiseParallel()``: it splits the embedding's features, and the blocks read half."""
    fixed(model, mesh)
    return parallelize_module(model, mesh["TP"], {"embed": ColwiseParallel()})  # type: ignore[index]


def _each(model: nn.Module, mesh: object, styles: dict) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh["TP"], {k: style() for k, style in styles.items()})  # type: ignore[index]
    return model


def no_down(model: nn.Module, mesh: object) -> nn.Module:
    return _each(model, mesh, {"up": ColwiseParallel})


def no_up(model: nn.Module, mesh: object) -> nn.Module:
    return _each(model, mesh, {"gate": ColwiseParallel, "down": RowwiseParallel})


def swapped(model: nn.Module, mesh: object) -> nn.Module:
    return _each(model, mesh, {"gate": RowwiseParallel, "up": RowwiseParallel, "down": ColwiseParallel})


def step(model: nn.Module, micro_batch_size: int) -> None:
    model(torch.randn(micro_batch_size, 16)).pow(2).mean().backward()


def step_forward_only(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """The loss, and no ``backward()``: one process's parameters have no gradient after it."""
    return model(torch.randn(micro_batch_size, 16)).pow(2).mean()
