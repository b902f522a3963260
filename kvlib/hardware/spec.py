"""A machine's limits as data: each figure with where it comes from (a datasheet, a measurement, a stated floor).

What kvlib.projection reads a run's counted work against: device memory bandwidth, peak FLOP/s per dtype, the
host-device link (bandwidth each way and a per-transfer latency; `unified` where host and device are one memory, as
on a CPU: a crossing then costs nothing beyond the reads already counted), disk bandwidth where known, device memory,
and which of aiconfigurator-core's measured kernel tables stand for its GPU, if any.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlib.errors import UserError


@dataclass(frozen=True)
class Figure:
    value: float | None  # None: not known (a time it would cost is not charged, so a bound stays a bound)
    source: str


@dataclass(frozen=True)
class Spec:
    name: str
    description: str
    memory_bandwidth: Figure  # B/s
    peak_flops: dict[str, Figure]  # FLOP/s per dtype name
    device_memory: Figure  # B
    link_bandwidth: Figure | None  # B/s each way; None: unified (host and device are one memory)
    link_latency: Figure | None  # s per transfer
    disk_bandwidth: Figure  # B/s
    kernel_system: str | None = None  # aiconfigurator-core's system whose measured tables stand for this GPU
    kernel_source: str = ""
    extra: dict = field(default_factory=dict)  # what else the source said (this machine's raw measures)

    @property
    def unified(self) -> bool:
        return self.link_bandwidth is None

    def peak(self, dtype: str | None = None) -> float:
        """The peak FLOP/s for `dtype`; where the spec has no figure for it (or no dtype is named), its highest
        (still a bound)."""
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype].value)
        return max(float(f.value) for f in self.peak_flops.values())

    def figures(self) -> dict[str, Figure]:
        """Every figure by a dotted name: what a table of the spec shows, each with its source."""
        out = {"memory_bandwidth": self.memory_bandwidth, "device_memory": self.device_memory,
               "disk_bandwidth": self.disk_bandwidth}
        out |= {f"peak_flops.{dtype}": fig for dtype, fig in self.peak_flops.items()}
        if self.unified:
            out["link"] = Figure(None, "unified: host and device are one memory (no bus to cross)")
        else:
            out |= {"link.bandwidth": self.link_bandwidth, "link.latency": self.link_latency}
        return out

    def table(self):
        """The spec as rows (figure, value, source) for a notebook."""
        import pandas as pd

        return pd.DataFrame([{"hardware": self.name, "figure": name, "value": fig.value, "source": fig.source}
                             for name, fig in self.figures().items()])

    @classmethod
    def from_dict(cls, data: dict, where: str) -> Spec:
        """From a spec file's mapping (kvlib/hardware/specs/*.yaml is the format); `where` names it in errors."""
        try:
            link = data["link"]
            unified = link == "unified"
            kernels = data.get("kernel_database") or {}
            return cls(name=str(data["name"]), description=str(data.get("description", "")),
                       memory_bandwidth=_figure(data["memory_bandwidth"], where, "memory_bandwidth"),
                       peak_flops={k: _figure(v, where, f"peak_flops.{k}") for k, v in data["peak_flops"].items()},
                       device_memory=_figure(data["device_memory"], where, "device_memory"),
                       link_bandwidth=None if unified else _figure(link["bandwidth"], where, "link.bandwidth"),
                       link_latency=None if unified else _figure(link["latency"], where, "link.latency"),
                       disk_bandwidth=_figure(data.get("disk_bandwidth", {"value": None, "source": "not given"}),
                                              where, "disk_bandwidth"),
                       kernel_system=kernels.get("system"), kernel_source=str(kernels.get("source", "")))
        except (KeyError, TypeError) as error:
            raise UserError(f"hardware spec {where}: missing or malformed {error} (see kvlib/hardware/specs/"
                            f"h100_sxm.yaml for the format)") from None


def _figure(entry, where: str, name: str) -> Figure:
    if not isinstance(entry, dict) or "value" not in entry or not entry.get("source"):
        raise UserError(f"hardware spec {where}: {name} needs a value and a source, got {entry!r}")
    value = entry["value"]
    if isinstance(value, str):  # YAML 1.1 reads 3.35e12 (no sign in the exponent) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if value is not None and (not isinstance(value, (int, float)) or value <= 0):
        raise UserError(f"hardware spec {where}: {name} must be a positive number or null, got {value!r}")
    return Figure(None if value is None else float(value), str(entry["source"]))
