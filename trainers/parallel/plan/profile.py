"""Per-block profiles: :class:`BlockProfile`, :class:`Profile` and their JSON files
(:func:`load_profile`, :func:`save_profile`); the quantities are those of the package
docstring (:mod:`trainers.parallel.plan`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainers.parallel.plan._io import _MISSING, _check_unknown, _get, _read_json, _write_json

PROFILE_FORMAT = 1


@dataclass(frozen=True)
class BlockProfile:
    """One block's costs at the profile's micro-batch (see the module docstring).

    Attributes:
        name: e.g. ``"embeddings"``, ``"layer3"``, ``"head"``.
        forward_s: forward seconds ``F_k``; ``forward_fixed_s`` of it do not scale with the batch.
        backward_s: backward seconds ``B_k`` (input gradient included); ``backward_fixed_s``.
        activation_bytes: bytes saved for the backward ``a_k``.
        output_bytes: bytes of the outputs ``o_k`` (sent to the next stage; the gradient sent
            back is taken to be as large).
        param_bytes: parameter bytes ``w_k``.
        optimizer_s: one AdamW step over the block's parameters ``O_k`` (batch-independent),
            timed with the caches evicted (in a step, its state is read from memory).
        grad_copy_s: what data parallelism adds around the all-reduce of the block's
            gradients ``C_k``: the copy into a flat bucket, the division by the replica count
            and the copy back (DDP's buckets), timed like ``optimizer_s``; 0: not measured.
        tensor_parallel: tensor parallelism splits the block (BERT's layers).
        tp_param_bytes: the part of ``param_bytes`` that is sharded ``w^tp_k``.
        tp_activation_bytes: the part of ``activation_bytes`` that is sharded ``a^tp_k``.
        tp_allreduce_bytes: bytes of one of its four all-reduces ``r_k``.
        flops: forward + backward floating-point operations (0: unknown).
        tp_time_ratio: per tensor-parallel degree ``t`` (a string key, JSON's), the measured
            forward + backward time of one rank's share of the layer (``num_heads / t`` heads,
            ``intermediate / t`` units) over the whole layer's, ``rho_k(t)``; a degree not
            listed is taken to split the time perfectly (``1 / t``).
        tp_times: per degree ``t``, the block's ``forward_s``, ``backward_s``,
            ``forward_fixed_s`` and ``backward_fixed_s`` with its layer really sharded
            (DTensor, one rank of a fake process group: local compute and DTensor's
            per-operation overhead, no communication; :mod:`._tp_probe`). Where a degree is
            listed the planner takes these in place of ``rho_k(t)`` times the whole block's.
        batch_times: per larger micro-batch ``b`` (a string key, above the profile's), the
            block's ``forward_s`` and ``backward_s`` measured at ``b``: above the profile's
            batch the planner interpolates between the measured batches instead of following
            the line through the profile's two (the time per sample grows with the batch once
            the activations leave the caches); empty: the line.
    """

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: float
    output_bytes: float
    param_bytes: float
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    optimizer_s: float = 0.0
    grad_copy_s: float = 0.0
    tensor_parallel: bool = False
    tp_param_bytes: float = 0.0
    tp_activation_bytes: float = 0.0
    tp_allreduce_bytes: float = 0.0
    flops: float = 0.0
    tp_time_ratio: dict[str, float] = field(default_factory=dict)
    tp_times: dict[str, dict[str, float]] = field(default_factory=dict)
    batch_times: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> BlockProfile:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a JSON object, got {data!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        _check_unknown(data, names, where)
        values: dict[str, Any] = {"name": _get(data, "name", where, str)}
        for f in dataclasses.fields(cls)[1:]:
            if f.name == "tensor_parallel":
                values[f.name] = _get(data, f.name, where, bool, default=False)
            elif f.name == "tp_time_ratio":
                ratios = _get(data, f.name, where, dict, default={})
                for key, value in ratios.items():
                    if not (key.isdigit() and int(key) > 1) or isinstance(value, bool) or not (
                        isinstance(value, (int, float)) and 0 < value <= 100
                    ):  # fmt: skip
                        raise ValueError(
                            f"{where}: field 'tp_time_ratio' maps degrees > 1 (as strings) to "
                            f"time ratios in (0, 100]; got {key!r}: {value!r}"
                        )
                values[f.name] = {k: float(v) for k, v in ratios.items()}
            elif f.name == "tp_times":
                values[f.name] = _tp_times(_get(data, f.name, where, dict, default={}), where)
            elif f.name == "batch_times":
                values[f.name] = _batch_times(_get(data, f.name, where, dict, default={}), where)
            else:
                default = _MISSING if f.default is dataclasses.MISSING else f.default
                values[f.name] = _get(data, f.name, where, float, default=default, minimum=0.0)
        for part, whole in (
            ("forward_fixed_s", "forward_s"),
            ("backward_fixed_s", "backward_s"),
            ("tp_param_bytes", "param_bytes"),
            ("tp_activation_bytes", "activation_bytes"),
        ):
            if values[part] > values[whole] * (1 + 1e-9):
                raise ValueError(
                    f"{where}: field {part!r} ({values[part]:g}) is larger than {whole!r} "
                    f"({values[whole]:g}); it is the part of it that {_PART_OF[part]}"
                )
        if not values["tensor_parallel"]:
            for name in ("tp_param_bytes", "tp_activation_bytes", "tp_allreduce_bytes",
                         "tp_time_ratio", "tp_times"):  # fmt: skip
                if values[name]:
                    raise ValueError(
                        f"{where}: field {name!r} is set but 'tensor_parallel' is false; set "
                        "'tensor_parallel': true for a block that tensor parallelism splits"
                    )
        return cls(**values)


_TP_TIME_KEYS = ("forward_s", "backward_s", "forward_fixed_s", "backward_fixed_s")
_BATCH_TIME_KEYS = ("forward_s", "backward_s")


def _times_by(data: dict[str, Any], where: str, name: str, least: int, what: str,
              keys: tuple[str, ...]) -> dict[str, dict[str, float]]:  # fmt: skip
    """Field ``name``: integers >= ``least`` as strings (``what``) -> objects with exactly the
    seconds ``keys``, each >= 0."""
    out = {}
    for key, times in data.items():
        ok = key.isdigit() and int(key) >= least and isinstance(times, dict)
        ok = ok and set(times) == set(keys)
        ok = ok and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
            for v in times.values()
        )
        if not ok:
            raise ValueError(
                f"{where}: field {name!r} maps {what} (as strings) to objects with the seconds "
                f"{', '.join(keys)} (>= 0); got {key!r}: {times!r}"
            )
        out[key] = {k: float(times[k]) for k in keys}
    return out


def _tp_times(data: dict[str, Any], where: str) -> dict[str, dict[str, float]]:
    """Field ``tp_times``: degrees > 1 (strings) -> the four times, seconds >= 0, each per-call
    part at most its whole."""
    out = _times_by(data, where, "tp_times", 2, "degrees > 1", _TP_TIME_KEYS)
    for key, times in out.items():
        for part, whole in (("forward_fixed_s", "forward_s"), ("backward_fixed_s", "backward_s")):
            if times[part] > times[whole] * (1 + 1e-9):
                raise ValueError(
                    f"{where}: field 'tp_times' at degree {key}: {part} ({times[part]:g}) is "
                    f"larger than {whole} ({times[whole]:g})"
                )
    return out


def _batch_times(data: dict[str, Any], where: str) -> dict[str, dict[str, float]]:
    """Field ``batch_times``: micro-batches (strings of positive integers) -> the forward and
    backward seconds there (>= 0)."""
    return _times_by(data, where, "batch_times", 1, "micro-batch sizes", _BATCH_TIME_KEYS)


_PART_OF = {
    "forward_fixed_s": "does not scale with the micro-batch",
    "backward_fixed_s": "does not scale with the micro-batch",
    "tp_param_bytes": "tensor parallelism shards",
    "tp_activation_bytes": "tensor parallelism shards",
}


@dataclass(frozen=True)
class Profile:
    """Per-block costs of a model at micro-batch ``batch`` (JSON: :meth:`to_dict`).

    The JSON schema (``format`` 1)::

        {"format": 1, "model": "bert_24_1024_16", "model_config": {...overrides...},
         "seq_len": 128 | "image_size": 224, "batch": 4,
         "tensor_parallel_degrees": [1, 2, 4, 8, 16],
         "source": {"device": "cpu", "cpu_capability": "AVX512", "torch": "2.13.0", ...},
         "blocks": [{"name": "embeddings", "forward_s": 0.01, "backward_s": 0.02,
                     "activation_bytes": 1e6, "output_bytes": 2e6, "param_bytes": 1.3e8,
                     ...the optional fields of BlockProfile...}, ...]}

    Exactly one of ``seq_len`` (BERT) and ``image_size`` (ResNeSt) is given.
    ``tensor_parallel_degrees`` lists the degrees the model divides into (BERT: those that
    divide the head count and the intermediate size; always includes 1).
    """

    model: str
    batch: int
    blocks: tuple[BlockProfile, ...]
    seq_len: int | None = None
    image_size: int | None = None
    tensor_parallel_degrees: tuple[int, ...] = (1,)
    model_config: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": PROFILE_FORMAT, "model": self.model}
        if self.model_config:
            data["model_config"] = dict(self.model_config)
        if self.seq_len is not None:
            data["seq_len"] = self.seq_len
        if self.image_size is not None:
            data["image_size"] = self.image_size
        data["batch"] = self.batch
        data["tensor_parallel_degrees"] = list(self.tensor_parallel_degrees)
        data["source"] = dict(self.source)
        data["blocks"] = [dataclasses.asdict(b) for b in self.blocks]
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> Profile:
        """Validated; errors name ``where`` (the file) and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a profile is a JSON object, got {type(data).__name__}")
        known = ("format", "model", "model_config", "seq_len", "image_size", "batch",
                 "tensor_parallel_degrees", "source", "blocks")  # fmt: skip
        _check_unknown(data, known, where)
        fmt = _get(data, "format", where, int)
        if fmt != PROFILE_FORMAT:
            raise ValueError(
                f"{where}: field 'format' is {fmt}; this planner reads format {PROFILE_FORMAT}"
            )
        model = _get(data, "model", where, str)
        seq_len = _get(data, "seq_len", where, int, default=None, minimum=1)
        image_size = _get(data, "image_size", where, int, default=None, minimum=1)
        if (seq_len is None) == (image_size is None):
            raise ValueError(
                f"{where}: give exactly one of the fields 'seq_len' (BERT) and 'image_size' "
                "(ResNeSt)"
            )
        batch = _get(data, "batch", where, int, minimum=1)
        degrees = _get(data, "tensor_parallel_degrees", where, list, default=[1])
        if not degrees or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in degrees
        ) or 1 not in degrees:  # fmt: skip
            raise ValueError(
                f"{where}: field 'tensor_parallel_degrees' must be a list of positive integers "
                f"that includes 1, got {degrees!r}"
            )
        blocks_data = _get(data, "blocks", where, list)
        if not blocks_data:
            raise ValueError(f"{where}: field 'blocks' is empty; a profile needs its blocks")
        blocks = tuple(
            BlockProfile.from_dict(b, f"{where}: blocks[{i}]") for i, b in enumerate(blocks_data)
        )
        for i, b in enumerate(blocks):
            low = [m for m in b.batch_times if int(m) <= batch]
            if low:
                raise ValueError(
                    f"{where}: blocks[{i}]: field 'batch_times' has micro-batches {low}; it holds "
                    f"only those above the profile's 'batch' ({batch})"
                )
        return cls(
            model=model,
            batch=batch,
            blocks=blocks,
            seq_len=seq_len,
            image_size=image_size,
            tensor_parallel_degrees=tuple(sorted(set(degrees))),
            model_config=dict(_get(data, "model_config", where, dict, default={})),
            source=dict(_get(data, "source", where, dict, default={})),
        )

    def scaled(self, compute_scale: float) -> Profile:
        """Every time (compute, optimizer and bucket copies) multiplied by ``compute_scale``
        (a device that is ``1 / compute_scale`` times as fast as the profiling one)."""
        if not compute_scale > 0:
            raise ValueError(f"compute scale must be > 0, got {compute_scale}")
        times = ("forward_s", "backward_s", "forward_fixed_s", "backward_fixed_s", "optimizer_s",
                 "grad_copy_s")  # fmt: skip
        blocks = tuple(
            dataclasses.replace(
                b,
                **{t: getattr(b, t) * compute_scale for t in times},
                tp_times={
                    d: {k: v * compute_scale for k, v in ts.items()} for d, ts in b.tp_times.items()
                },  # fmt: skip
                batch_times={
                    m: {k: v * compute_scale for k, v in ts.items()}
                    for m, ts in b.batch_times.items()
                },
            )
            for b in self.blocks
        )
        previous = float(self.source.get("compute_scale", 1.0))
        source = {**self.source, "compute_scale": previous * compute_scale}
        return dataclasses.replace(self, blocks=blocks, source=source)

    def achieved_tflops(self) -> float:
        """Floating-point rate of the profiled forward + backward passes (0: no FLOP counts)."""
        flops = sum(b.flops for b in self.blocks)
        seconds = sum(b.forward_s + b.backward_s for b in self.blocks)
        return flops / seconds / 1e12 if flops > 0 and seconds > 0 else 0.0

    def description(self) -> str:
        """``"bert_24_1024_16 (num_layers=48, ...), seq 128"``: the model and its input."""
        text = self.model
        if self.model_config:
            text += " (" + ", ".join(f"{k}={v}" for k, v in self.model_config.items()) + ")"
        if self.seq_len is not None:
            return f"{text}, seq {self.seq_len}"
        return f"{text}, image {self.image_size}"


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """A profile JSON file (schema: :class:`Profile`); ``ValueError`` names the file and field."""
    return Profile.from_dict(_read_json(path, "profile"), where=str(path))


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` atomically (temporary file + ``os.replace``)."""
    return _write_json(path, profile.to_dict())
