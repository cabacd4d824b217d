"""The mesh spec: ``init_device_mesh`` arguments, parsed and validated once.

Everything a user can get wrong in ``init_device_mesh(device_type, mesh_shape,
mesh_dim_names=...)`` is caught here with a one-line :class:`MeshSpecError` (a ``ValueError``)
that names the bad value and the valid choices, without pydantic's dump of the input.
The one check that needs the process group, the world size, is
:meth:`MeshSpec.resolve`.
"""

from __future__ import annotations

from collections.abc import Sequence

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from vemesh.layout.mesh_layout import MeshLayout
from vemesh.layout.names import STANDARD_STRATEGIES, as_index, check_dim_names, fill_sizes

__all__ = ["DEFAULT_DIM_NAMES", "STANDARD_STRATEGIES", "VALID_DEVICE_TYPES", "MeshSpec", "MeshSpecError"]

#: Dim names used when ``mesh_dim_names`` is not given, by number of dims.
DEFAULT_DIM_NAMES: dict[int, tuple[str, ...]] = {
    1: ("DP",),
    2: ("DP", "TP"),
    3: ("PP", "DP", "TP"),
}

#: Device types a mesh can be built on.
VALID_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "xpu", "hpu", "npu", "mtia", "mps")


class MeshSpecError(ValueError):
    """A bad ``init_device_mesh`` argument, in one line; ``field`` names the argument (empty for the combination)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def one_line(error: ValidationError) -> list[tuple[str, str]]:
    """Each of pydantic's errors as ``(field, message)``: the validator's own text, not pydantic's decoration."""
    out = []
    for err in error.errors():
        cause = (err.get("ctx") or {}).get("error")
        text = str(cause) if cause is not None else str(err["msg"]).removeprefix("Value error, ")
        out.append((str(err["loc"][0]) if err["loc"] else "", text))
    return out


class MeshSpec(BaseModel):
    """A validated ``init_device_mesh`` request; ``-1`` is kept until :meth:`resolve`.

    >>> MeshSpec(device_type="cuda:0", mesh_shape=(2, -1))  # doctest: +SKIP
    MeshSpec(device_type='cuda', mesh_shape=(2, -1), mesh_dim_names=('DP', 'TP'))
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:  # one line naming the value, not pydantic's multi-line dump
            errors = one_line(e)
            raise MeshSpecError("; ".join(text for _, text in errors), errors[0][0]) from None

    device_type: str
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None = None

    @field_validator("device_type", mode="before")
    @classmethod
    def _device_type(cls, value: object) -> str:
        text = getattr(value, "type", value)  # accept torch.device("cuda", 1)
        if not isinstance(text, str):
            raise ValueError(f"device_type must be a string such as 'cpu' or 'cuda'; got {value!r}")
        base = text.partition(":")[0]
        if base not in VALID_DEVICE_TYPES:
            raise ValueError(f"unknown device type {text!r}; valid device types are {list(VALID_DEVICE_TYPES)}")
        return base

    @field_validator("mesh_shape", mode="before")
    @classmethod
    def _mesh_shape(cls, value: object) -> tuple[int, ...]:
        if isinstance(value, int):
            value = (value,)
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ValueError(f"mesh_shape must be a tuple of ints such as (2, 4); got {value!r}")
        given = tuple(value)
        if not given:
            raise ValueError("mesh_shape must have at least one dim; got ()")
        shape = tuple(as_index(s, f"every mesh_shape entry (in {given})") for s in given)
        return fill_sizes(shape, None, what="mesh_shape")

    @field_validator("mesh_dim_names", mode="before")
    @classmethod
    def _names(cls, value: object) -> tuple[str, ...] | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = (value,)
        return check_dim_names(value)

    @model_validator(mode="after")
    def _names_match_shape(self) -> MeshSpec:
        n = len(self.mesh_shape)
        if self.mesh_dim_names is None:
            if n not in DEFAULT_DIM_NAMES:
                raise ValueError(
                    f"a {n}-D mesh_shape {self.mesh_shape} needs mesh_dim_names; defaults exist only "
                    f"for {', '.join(f'{k}-D {v}' for k, v in DEFAULT_DIM_NAMES.items())}"
                )
            object.__setattr__(self, "mesh_dim_names", DEFAULT_DIM_NAMES[n])
        elif len(self.mesh_dim_names) != n:
            raise ValueError(
                f"mesh_dim_names {self.mesh_dim_names} has {len(self.mesh_dim_names)} names "
                f"but mesh_shape {self.mesh_shape} has {n} dims"
            )
        return self

    def resolve(self, world_size: int, rank_offset: int | None = None) -> MeshLayout:
        """Fill in a ``-1`` and check the mesh fits the world.

        Without ``rank_offset`` the product must equal ``world_size``: torch accepts a mesh
        smaller than the world, but the ranks left out would silently take no part in training.
        With ``rank_offset`` the mesh covers the ranks from ``rank_offset`` on (a ``-1`` takes all
        of them): ``(2, 2)`` with ``rank_offset=4`` in a world of 8 is ranks 4..7.
        """
        first = 0
        if rank_offset is not None:
            first = as_index(rank_offset, "rank_offset")
            if not 0 <= first < world_size:
                raise ValueError(f"rank_offset {first} is outside the world of {world_size} ranks; valid: 0..{world_size - 1}")
        if rank_offset is None:
            of, hint = "the world size", "; or rank_offset= for a mesh over part of the world"
        else:
            of, hint = f"the number of ranks from rank_offset {first} on ({first}..{world_size - 1})", ""
        shape = fill_sizes(self.mesh_shape, world_size - first, names=self.mesh_dim_names, what="mesh_shape", of=of,
                           exact=rank_offset is None, hint=hint)
        assert self.mesh_dim_names is not None
        return MeshLayout(shape, self.mesh_dim_names, first_rank=first)
