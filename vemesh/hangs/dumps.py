"""Reading hang dumps: vemesh's (``rank-N.json``) and torch's own Flight Recorder files.

Everything here is plain Python over the files: no process group, no torch. A job is a set of
ranks, each with its recorded collectives (:class:`Entry`), its threads' stacks and the groups it
was in, named by mesh dim. vemesh's dumps carry the mesh; torch's own dumps (written through
``TORCH_FR_DUMP_TEMP_FILE`` or ``_dump_fr_trace``) carry only process-group names and
descriptions, which a mesh shape and dim names map back: torch's ``DeviceMesh`` names each dim's
groups ``mesh_<dim>``.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Entry", "Group", "Job", "Layout", "RankDump", "dead_line", "load", "rank_place"]

_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
                "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "ComplexFloat": 8}


@dataclass(frozen=True)
class Layout:
    """Where each rank sits: sizes, names and strides of the mesh (row-major unless the mesh said otherwise)."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    strides: tuple[int, ...]
    first_rank: int = 0

    @staticmethod
    def row_major(shape: tuple[int, ...], dim_names: tuple[str, ...]) -> "Layout":
        if len(shape) != len(dim_names):
            raise ValueError(f"--shape {list(shape)} has {len(shape)} dims but --dim-names {list(dim_names)} has {len(dim_names)}")
        if min(shape, default=0) < 1:
            raise ValueError(f"--shape {list(shape)}: every size must be a positive integer")
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc *= size
        return Layout(tuple(shape), tuple(dim_names), tuple(reversed(strides)))

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def coordinate(self, rank: int) -> dict[str, int]:
        r = rank - self.first_rank
        return {n: (r // st) % s for n, s, st in zip(self.dim_names, self.shape, self.strides)}

    def group(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """The ranks that differ from ``rank`` only along ``dims``."""
        ranks = [rank]
        for d in dims:
            i = self.dim_names.index(d)
            c = self.coordinate(rank)[d]
            ranks = [r + (k - c) * self.strides[i] for r in ranks for k in range(self.shape[i])]
        return sorted(ranks)

    def dims_of(self, desc: str) -> tuple[str, ...] | None:
        """The dims a torch ``DeviceMesh`` group description names (``mesh_dp``, ``mesh_dp_cp``), or None."""
        name = desc[len("mesh_"):] if desc.startswith("mesh_") else desc
        if name in self.dim_names:
            return (name,)
        for i in range(1, len(name)):  # a flattened name: dims joined by "_" (a dim name may hold "_" too)
            if name[:i] in self.dim_names and name[i] == "_":
                rest = self.dims_of(name[i + 1:])
                if rest is not None:
                    return (name[:i], *rest)
        return None


def rank_place(mesh: dict[str, Any], rank: int) -> tuple[str, str]:
    """``("DP=1, TP=0", "; its groups: DP [0, 2], TP [2, 3]")`` for ``rank`` in a dump's mesh description (empty
    strings when the description lacks the layout)."""
    try:
        layout = Layout(tuple(mesh["shape"]), tuple(mesh["dim_names"]), tuple(mesh["strides"]), mesh.get("first_rank", 0))
        where = ", ".join(f"{d}={c}" for d, c in layout.coordinate(rank).items())
        return where, "; its groups: " + ", ".join(f"{d} {layout.group(rank, (d,))}" for d in layout.dim_names)
    except (KeyError, TypeError, ValueError):
        return "", ""


def dead_line(rank: int, where: str, groups: str) -> str:
    """``DEAD: rank R (coordinates): ...; its groups: ...`` (:func:`rank_place`'s two strings)."""
    return (f"DEAD: rank {rank}{f' ({where})' if where else ''}: its heartbeat stopped and it left no dump "
            f"(killed, OOM-killed, or it exited){groups}\n")


@dataclass
class Entry:
    """One collective of one rank, as torch's Flight Recorder saw it."""

    rank: int
    pg: str
    seq: int  # the group's collective number (its p2p number for a send or receive)
    op: str  # "all-reduce", "all-gather", ...
    sizes: list[list[int]]
    dtypes: list[str]
    time_ns: int  # when the rank entered it (wall clock of its host)
    done: bool
    p2p: bool

    @property
    def nbytes(self) -> int:
        total = 0
        for size, dtype in zip(self.sizes, self.dtypes):
            n = 1
            for s in size:
                n *= s
            total += n * _DTYPE_BYTES.get(dtype, 4)
        return total

    def shape_text(self) -> str:
        return " + ".join(str(list(s)) for s in self.sizes) + (f" {self.dtypes[0].lower()}" if self.dtypes else "")


@dataclass
class Group:
    name: str  # the process group's name (the same on every rank)
    dim: str  # the mesh name it is the group of ("DP", "dp_cp", "world"), or "group <name>" when unknown
    ranks: list[int]


@dataclass
class RankDump:
    rank: int
    entries: list[Entry] = field(default_factory=list)
    stacks: list[dict[str, Any]] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)
    host: str = ""
    fatal: str = ""  # what faulthandler wrote when the process died (gloo aborts a rank on a size mismatch)
    dumped: bool = True
    ended: bool = False  # the dump was written as the rank's program ended (at the interpreter's normal exit)
    exception: str = ""  # the traceback, when the rank's script raised
    #: pg name -> this rank's group of that name (a name is the same on every rank, its ranks are not:
    #: torch's mesh makes DP's groups [0, 2] and [1, 3] under one name)
    groups: dict[str, Group] = field(default_factory=dict)

    def step_at(self, time_ns: int) -> int | None:
        found = None
        for t, step in self.steps:
            if t > time_ns:
                break
            found = step
        return found


@dataclass
class Job:
    ranks: dict[int, RankDump]
    layout: Layout | None
    world_size: int
    fired_by: int | None = None
    reason: str = ""
    source: str = "vemesh"  # or "torch"
    older: int = 0  # dumps of an older run in the same directory, left out

    def group_of(self, rank: int, pg: str) -> Group:
        """``rank``'s group named ``pg``: from its own dump, else from a member's that lists it."""
        dump = self.ranks.get(rank)
        if dump is not None and pg in dump.groups:
            return dump.groups[pg]
        for other in self.ranks.values():
            g = other.groups.get(pg)
            if g is not None and rank in g.ranks:
                return g
        return Group(pg, f"group {pg}", [rank])

    def coordinate_text(self, rank: int, skip: tuple[str, ...] = ()) -> str:
        if self.layout is None:
            return ""
        return ", ".join(f"{n}={c}" for n, c in self.layout.coordinate(rank).items() if n not in skip)


def _op(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[-1].replace("_", "-")


def _entries(rank: int, fr: dict[str, Any]) -> list[Entry]:
    out = []
    for e in fr.get("entries", []):
        p2p = bool(e.get("is_p2p", False))
        pg = e.get("process_group") or ["", ""]
        out.append(Entry(
            rank=rank, pg=str(pg[0]), seq=int(e["p2p_seq_id"] if p2p else e["collective_seq_id"]),
            op=_op(str(e.get("profiling_name", "?"))), sizes=[list(s) for s in e.get("input_sizes", [])],
            dtypes=list(e.get("input_dtypes", [])), time_ns=int(e.get("time_created_ns", 0)),
            done=bool(e.get("retired")) or e.get("state") == "completed", p2p=p2p,
        ))
    return out


def _raised_in(exception: str, entries: list[Entry]) -> Entry | None:
    """The collective the rank raised in, when its traceback ends waiting in torch's synchronous call of one
    (``distributed_c10d.py``, ``work.wait()``: gloo's "Connection closed by peer" as the peers end): its latest entry,
    which the recorder marks retired as if it had finished. None otherwise (an error before the collective was
    recorded, or in the rank's own code)."""
    lines = [line.strip() for line in exception.strip().splitlines()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames or "distributed_c10d.py" not in lines[frames[-1]] or \
            not any("wait()" in line for line in lines[frames[-1] + 1:frames[-1] + 3]):
        return None
    return max(entries, key=lambda e: e.time_ns, default=None)


def _descs(fr: dict[str, Any]) -> dict[str, str]:
    return {str(e["process_group"][0]): str(e["process_group"][1]) for e in fr.get("entries", []) if e.get("process_group")}


def rank_dump(doc: dict[str, Any], known: RankDump | None = None) -> RankDump:
    """One rank of a vemesh dump document (``rank-N.json``, or what a live straggler summary gathers)."""
    rank = int(doc["rank"])
    dump = known or RankDump(rank)
    dump.dumped, dump.host, dump.exception = True, doc.get("host", ""), doc.get("exception", "")
    dump.ended = bool(doc.get("ended"))
    dump.entries = _entries(rank, doc["flight_recorder"])
    raised_in = _raised_in(dump.exception, dump.entries)
    if raised_in is not None:  # gloo retires the collective a rank raised in: it did not finish
        raised_in.done = False
    dump.stacks, dump.steps = doc.get("stacks", []), [tuple(s) for s in doc.get("steps", [])]
    groups = doc.get("mesh", {}).get("groups", {})
    dump.groups = {name: Group(name, g["dim"], list(g["ranks"])) for name, g in groups.items()}
    return dump


class UnsafeDumpError(ValueError):
    """A file in the hang directory is a pickle that would import or call something: refused, nothing run."""


class _DumpUnpickler(pickle.Unpickler):
    """torch's Flight Recorder dump is a pickle of plain containers (dicts, lists, tuples, strings, numbers, None:
    checked on torch 2.13's ``_dump_fr_trace``), so no global may be resolved: a pickle that names one (``os.system``,
    ``builtins.eval``, a class to build) is refused before anything in it runs."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeDumpError(
            f"refusing to read {self.source}: it is a pickle that refers to {module}.{name}, and torch's Flight Recorder "
            "dumps hold only dicts, lists, strings and numbers; nothing in it was run. Remove it from the hang directory "
            "(it is corrupt, or someone put it there)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeDumpError(f"refusing to read {self.source}: it is a pickle with persistent references, which "
                              "torch's Flight Recorder dumps never hold; nothing in it was run")


def read_torch_dump(path: Path) -> Any:
    """A Flight Recorder dump unpickled safely (:class:`_DumpUnpickler`)."""
    return _DumpUnpickler(io.BytesIO(path.read_bytes()), path).load()


def load(directory: str | Path, shape: tuple[int, ...] | None = None, dim_names: tuple[str, ...] | None = None) -> Job:
    """Read every rank's dump under ``directory``; ``shape`` and ``dim_names`` map torch's own dumps to the mesh."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory of hang dumps")
    given = Layout.row_major(tuple(shape), tuple(dim_names)) if shape is not None and dim_names is not None else None
    if (shape is None) != (dim_names is None):
        raise ValueError("give --shape and --dim-names together (the mesh of the job that wrote torch's dumps)")
    ranks: dict[int, RankDump] = {}
    layout, world, fired_by, reason, torch_descs = given, 0, None, "", {}
    runs: dict[str, int] = {}  # run id -> its newest dump's time: a reused directory may hold an older run's
    docs = {}
    for path in directory.glob("rank-*.json"):
        try:
            doc = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a hang dump ({e}); vemesh writes each dump whole (to .tmp, then renamed), "
                             "so another program wrote this one: move it out of the directory and run again") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("rank"), int):
            raise ValueError(f"{path} is not a hang dump (no rank in it); move it out of the directory and run again")
        docs[path.name] = doc
        runs[doc.get("run", "")] = max(runs.get(doc.get("run", ""), 0), int(doc.get("time_ns", 0)))
    newest = max(runs, key=runs.get) if runs else ""
    older = sum(1 for d in docs.values() if d.get("run", "") != newest)
    for path in sorted(directory.iterdir()):
        if path.name.endswith(".fatal.txt"):
            text = path.read_text(errors="replace").strip()
            m = re.fullmatch(r"rank-(\d+)\.fatal\.txt", path.name)
            if text and m:
                ranks.setdefault(int(m.group(1)), RankDump(int(m.group(1)), dumped=False)).fatal = text
            continue
        if path.suffix == ".json" and path.name.startswith("rank-"):
            doc = docs[path.name]
            if doc.get("run", "") != newest:
                continue
            dump = rank_dump(doc, ranks.get(int(doc["rank"])))
            ranks[dump.rank] = dump
            mesh = doc.get("mesh", {})
            if layout is None and mesh:
                layout = Layout(tuple(mesh["shape"]), tuple(mesh["dim_names"]), tuple(mesh["strides"]), mesh.get("first_rank", 0))
            world = max(world, int(doc.get("world_size", 0)))
            if doc.get("fired_by") is not None:
                fired_by, reason = doc["fired_by"], doc.get("reason", "")
            continue
        m = re.search(r"(\d+)$", path.name)
        if m is None or path.suffix in (".json", ".txt", ".tmp"):
            continue
        try:  # torch's own dump: a pickle (TORCH_FR_DUMP_TEMP_FILE<rank>), read without running anything in it
            fr = read_torch_dump(path)
        except UnsafeDumpError:
            raise
        except Exception:
            continue
        if not isinstance(fr, dict) or "entries" not in fr:
            continue
        rank = int(m.group(1))
        ranks[rank] = RankDump(rank, entries=_entries(rank, fr))
        torch_descs[rank] = (_descs(fr), fr.get("pg_config", {}))
    if not ranks:
        raise FileNotFoundError(f"{directory} holds no hang dumps (rank-N.json from VEMESH_HANG_DIR, or torch's Flight "
                                "Recorder files ending in their rank)")
    source = "torch" if torch_descs else "vemesh"
    if torch_descs:
        if given is None:
            raise ValueError(f"{directory} holds torch's own Flight Recorder dumps, which do not say the mesh; give "
                             "--shape and --dim-names (e.g. --shape 2,2 --dim-names dp,tp)")
        world = layout.world_size
        if max(ranks) >= world:
            raise ValueError(f"--shape {list(layout.shape)} covers {world} ranks, but {directory} holds the dump of rank "
                             f"{max(ranks)}; give the shape of the mesh that wrote them")
        found = sorted({d for descs, _ in torch_descs.values() for d in descs.values() if d.startswith("mesh_")})
        if found and not any(layout.dims_of(d) for d in found):
            raise ValueError(f"--dim-names {','.join(layout.dim_names)} names none of the dumps' mesh groups "
                             f"({', '.join(found)}); give the names the job's DeviceMesh used")
        for rank, (descs, config) in torch_descs.items():
            groups = ranks[rank].groups
            for name, desc in descs.items():
                cfg = config.get(name)
                cfg_ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
                dims = layout.dims_of(desc)
                if desc == "default_pg":
                    groups[name] = Group(name, "world", list(range(world)))
                elif dims is not None:
                    groups[name] = Group(name, "_".join(dims), layout.group(rank, dims))
                elif cfg_ranks and cfg_ranks != "[]":
                    groups[name] = Group(name, f"group {name} ({desc})", json.loads(cfg_ranks))
    if world:  # a fatal-error file of a rank outside this run's world is an older run's
        ranks = {r: d for r, d in ranks.items() if r < world}
    world = world or (layout.world_size if layout else max(ranks) + 1)
    for dump in ranks.values():  # groups no dump described: the ranks seen in groups of that name
        for e in dump.entries:
            if e.pg not in dump.groups:
                seen = sorted({x.rank for d in ranks.values() for x in d.entries if x.pg == e.pg})
                dump.groups[e.pg] = Group(e.pg, f"group {e.pg}", seen)
    for r in range(world):
        ranks.setdefault(r, RankDump(r, dumped=False))
    return Job(ranks, layout, world, fired_by, reason, source, older)
