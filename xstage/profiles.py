"""Platform profiles: a JSON schema for M_X = (T_iss0, R, Q) and its loader.

Schema ``xstage-platform/1`` (units are in the key names)::

    {
      "schema": "xstage-platform/1",            # optional, checked if present
      "name": "h200-pcie-host",                 # required
      "source": "measured" | "paper",           # required
      "description": "...", "gpu": "...", "target": "host-pcie",
      "num_sms": 132,                            # required, int > 0
      "R_bytes_per_s": 2.4e10,                   # required, > 0
      "t_iss0_us": 0.76                          # required: number, or a table
          | {"K": [..], "V_bytes": [..], "us": [[..per V..] per K]},
      "Q_bytes": 4456448                         # required: number, or
          | {"132": 1.2e6, "66": 0.9e6},         #   a map from K to bytes
      "sigma_us_per_kv_tile": 0.79,              # optional (FA Q-loop slope, b_m = b_n = d = 128;
                                                 #   calibration.qloop fits it from the FA bench)
      "dense_tflops": 790,                       # optional (bf16 dense rate)
      "uncertainty": {...}, "provenance": {...}, "notes": {...}   # optional
    }

Profiles shipped with the package live in ``xstage/profiles/*.json``;
:func:`load` takes a shipped name or a file path.
"""
from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .model import CapacityTable, IssueTimeTable, Platform

__all__ = ["ProfileError", "SCHEMA", "available", "load", "from_dict", "to_dict"]

SCHEMA = "xstage-platform/1"

# The calibrated remote path of each world placement (xstage.world ``World.placement``): where a
# kernel's remote stores go. None: no remote path (loopback: "remote" stores are local HBM).
PROFILE_OF_PLACEMENT = {"loopback": None, "loopback+host": "h200-pcie-host", "host": "h200-pcie-host",
                        "torch-symm": "h200-nvlink-peer", "nvshmem": "h200-nvlink-peer"}
_REQUIRED = ("name", "source", "num_sms", "R_bytes_per_s", "t_iss0_us", "Q_bytes")
_SOURCES = ("measured", "paper")


class ProfileError(ValueError):
    """A profile is missing, malformed or physically meaningless."""


def _shipped_dir():
    return resources.files("xstage") / "profiles"


def available() -> list[str]:
    """Names of the profiles shipped with the package."""
    return sorted(p.name[:-5] for p in _shipped_dir().iterdir() if p.name.endswith(".json"))


def _num(where: str, key: str, v: Any, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProfileError(f"{where}: '{key}' must be a number, got {v!r}")
    if positive and v <= 0:
        raise ProfileError(f"{where}: '{key}' must be > 0, got {v!r}")
    return float(v)


def _t_iss0(where: str, spec: Any):
    if isinstance(spec, Mapping):
        try:
            ks, vs, us = spec["K"], spec["V_bytes"], spec["us"]
        except KeyError as e:
            raise ProfileError(f"{where}: 't_iss0_us' table needs keys K, V_bytes, us (missing {e})") from None
        try:
            return IssueTimeTable(
                ks=tuple(_num(where, "t_iss0_us.K", k) for k in ks),
                volumes=tuple(_num(where, "t_iss0_us.V_bytes", v) for v in vs),
                seconds=tuple(tuple(_num(where, "t_iss0_us.us", u) * 1e-6 for u in row) for row in us),
            )
        except (TypeError, ValueError) as e:
            raise ProfileError(f"{where}: bad 't_iss0_us' table: {e}") from None
    return _num(where, "t_iss0_us", spec) * 1e-6


def _q(where: str, spec: Any):
    if isinstance(spec, Mapping):
        try:
            pairs = sorted((int(k), _num(where, f"Q_bytes[{k}]", v)) for k, v in spec.items())
        except ValueError as e:
            if isinstance(e, ProfileError):
                raise
            raise ProfileError(f"{where}: 'Q_bytes' keys must be integer producer counts K") from None
        if not pairs:
            raise ProfileError(f"{where}: 'Q_bytes' map is empty")
        return CapacityTable(ks=tuple(float(k) for k, _ in pairs), capacities=tuple(q for _, q in pairs))
    return _num(where, "Q_bytes", spec)


def from_dict(d: Any, where: str = "profile") -> Platform:
    """Validate a profile dict and build a :class:`Platform`."""
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: top level must be a JSON object")
    if "schema" in d and d["schema"] != SCHEMA:
        raise ProfileError(f"{where}: unsupported schema {d['schema']!r} (expected {SCHEMA!r})")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ProfileError(f"{where}: missing required key(s): {', '.join(missing)}")
    if d["source"] not in _SOURCES:
        raise ProfileError(f"{where}: 'source' must be one of {_SOURCES}, got {d['source']!r}")
    num_sms = d["num_sms"]
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
        raise ProfileError(f"{where}: 'num_sms' must be a positive integer, got {num_sms!r}")
    sigma = d.get("sigma_us_per_kv_tile")
    tflops = d.get("dense_tflops")
    return Platform(
        name=str(d["name"]),
        R=_num(where, "R_bytes_per_s", d["R_bytes_per_s"]),
        t_iss0=_t_iss0(where, d["t_iss0_us"]),
        Q=_q(where, d["Q_bytes"]),
        num_sms=num_sms,
        sigma=None if sigma is None else _num(where, "sigma_us_per_kv_tile", sigma) * 1e-6,
        dense_flops=None if tflops is None else _num(where, "dense_tflops", tflops) * 1e12,
        source=d["source"],
        description=str(d.get("description", "")),
        target=str(d.get("target", "")),
        gpu=str(d.get("gpu", "")),
        provenance=dict(d.get("provenance", {})),
        uncertainty=dict(d.get("uncertainty", {})),
    )


def to_dict(p: Platform) -> dict:
    """Inverse of :func:`from_dict` (for writing fitted profiles)."""
    if isinstance(p.t_iss0, IssueTimeTable):
        t0: Any = {"K": list(p.t_iss0.ks), "V_bytes": list(p.t_iss0.volumes),
                   "us": [[s * 1e6 for s in row] for row in p.t_iss0.seconds]}
    else:
        t0 = p.t_iss0 * 1e6
    if isinstance(p.Q, CapacityTable):
        q: Any = {str(int(k)): c for k, c in zip(p.Q.ks, p.Q.capacities)}
    else:
        q = p.Q
    d = {"schema": SCHEMA, "name": p.name, "source": p.source, "description": p.description,
         "gpu": p.gpu, "target": p.target, "num_sms": p.num_sms, "R_bytes_per_s": p.R,
         "t_iss0_us": t0, "Q_bytes": q}
    if p.sigma is not None:
        d["sigma_us_per_kv_tile"] = p.sigma * 1e6
    if p.dense_flops is not None:
        d["dense_tflops"] = p.dense_flops / 1e12
    if p.uncertainty:
        d["uncertainty"] = dict(p.uncertainty)
    if p.provenance:
        d["provenance"] = dict(p.provenance)
    return d


def _read_profile_file(path: Path) -> str:
    """The text of a profile file; a ProfileError naming the file if it is not one."""
    if path.is_dir():
        raise ProfileError(f"{path}: is a directory, not a profile JSON file")
    if not path.exists():
        raise ProfileError(f"profile file not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the profile: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a JSON profile (binary data, not UTF-8 text)") from None


def load(name_or_path: str | Path) -> Platform:
    """Load a shipped profile by name, or a profile JSON file by path."""
    s = str(name_or_path)
    if not s.strip():  # Path("") is the current directory: say what is wrong instead
        raise ProfileError(f"empty platform name; shipped profiles: {', '.join(available())}")
    path = Path(s)
    if s.endswith(".json") or path.exists() or "/" in s:
        text, where = _read_profile_file(path), str(path)
    else:
        res = _shipped_dir() / f"{s}.json"
        if not res.is_file():
            raise ProfileError(f"unknown platform {s!r}; shipped profiles: {', '.join(available())}")
        text, where = res.read_text(), s
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{where}: malformed JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    return from_dict(data, where)
