"""N nodes as network namespaces on one Linux machine, joined by a bridge, with capped links.

Topology (see ``shared/specs/network_lab.md`` for the measurements behind each choice)::

    mzlab-<name>-sw        a namespace holding the bridge ``br0`` (STP off) and one port per node
      port<i>  ──veth──  eth0 in mzlab-<name>-n<i>   198.18.0.<100+i>/24, lo up, no default route

* Every veth pair is made inside the switch namespace with its peer created directly in the
  node's namespace, so no interface ever appears in the root namespace: the root's links,
  addresses and routes are never touched.
* Addresses are in 198.18.0.0/15 (set aside for network benchmarks, RFC 2544); node ``i`` is
  ``198.18.0.<100+i>``, so the address strings sort like the node numbers (torchrun orders
  ranks by the local address string). IPv6 is off; there is no route out of the lab.
* A cap is a ``tc tbf`` on the node's ``eth0`` (what it sends) and one on its switch port
  (what it receives): full duplex, both directions capped. The bucket holds
  ``max(64 KiB, rate x 4 ms)`` (the kernel's 4 ms tick and one GSO packet; smaller buckets
  cut a 1 Gbit cap to a third and burn softirq time).
* A partition is the node's switch port set down: the cable pulled at the switch. The node's
  own interface stays configured; packets to and from it vanish until the port is up again.

Everything the lab makes carries its name prefix (``mzlab-``), so :func:`remove_labs` finds
and removes it, processes inside first, whoever made it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

__all__ = [
    "LAB_NETWORK",
    "PREFIX",
    "Lab",
    "LabError",
    "LabExists",
    "NodeCounters",
    "burst_bytes",
    "format_rate",
    "interface_tx_bytes",
    "list_labs",
    "missing_requirements",
    "node_address",
    "parse_rate",
    "remove_labs",
]

PREFIX = "mzlab-"
LAB_NETWORK = ipaddress.ip_network("198.18.0.0/15")
SUBNET_PREFIX = 24
FIRST_HOST = 100  # node i is 198.18.0.<100 + i>: three digits, so the strings sort by node
MAX_NODES = 99
NODE_IFNAME = "eth0"
BRIDGE = "br0"
TBF_LATENCY_MS = 10  # queue depth of the tbf (not a delay: this kernel has no netem)
_NAME = re.compile(r"^[a-z0-9]{1,12}$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit|bit/s|bps)?\s*$", re.IGNORECASE)
_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")


class LabError(RuntimeError):
    """The lab could not be built, used or removed (the message says what and what to do)."""


class LabExists(LabError):
    """A lab of that name is already up (a user's choice to change, not a failure)."""


def parse_rate(text: str, what: str = "rate") -> int:
    """``"100mbit"``, ``"1gbit"``, ``"500kbit"``, ``"1.5gbit"`` -> bits per second.

    Units are bits (``tc``'s ``kbit``/``mbit``/``gbit``); a bare number is bits per second.
    """
    match = _RATE.match(str(text))
    if not match or (match.group(0).lower().rstrip().endswith("bps")):
        raise ValueError(
            f"{what} {text!r}: give a rate in bits per second such as 100mbit, 1gbit or 500kbit"
        )
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    if value < 8e3:
        raise ValueError(f"{what} {text!r}: below 8kbit; give a rate such as 100mbit or 1gbit")
    if value > 100e9:
        raise ValueError(f"{what} {text!r}: above 100gbit; this lab is CPU-bound above ~1gbit")
    return int(value)


def format_rate(bits_per_second: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second:g}bit"


def burst_bytes(bits_per_second: int) -> int:
    """The tbf bucket: at least 4 ms of data at the rate and at least one 64 KiB GSO packet,
    plus 2 KiB because the kernel keeps the bucket in clock ticks and rounds it down."""
    return max(64 * 1024, int(bits_per_second / 8 * 0.004)) + 2048


def node_address(node: int) -> str:
    if not 0 <= node < MAX_NODES:
        raise ValueError(f"node {node}: the lab has nodes 0 to {MAX_NODES - 1}")
    return str(LAB_NETWORK.network_address + FIRST_HOST + node)


def interface_tx_bytes(ifname: str = NODE_IFNAME) -> int | None:
    """Bytes the caller's own network namespace sent through ``ifname`` (``/proc/net/dev``
    shows the reader's namespace): what a rank inside a lab node measures of itself.
    ``None`` where there is no such interface (on loopback, outside a lab)."""
    try:
        with open("/proc/net/dev", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == ifname:
                    return int(rest.split()[8])
    except OSError:
        return None
    return None


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in _SBIN:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    return None


def missing_requirements() -> str | None:
    """Why a lab cannot be made here, in one line; ``None`` when it can.

    Needs Linux, CAP_NET_ADMIN and CAP_SYS_ADMIN (``ip netns add`` mounts), and iproute2's
    ``ip`` and ``tc``.
    """
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux (no /proc/self/ns/net here)"
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            cap_eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return "cannot read this process's capabilities from /proc/self/status"
    lacking = [name for name, bit in (("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21))
               if not cap_eff >> bit & 1]  # fmt: skip
    if lacking:
        return f"needs root ({' and '.join(lacking)} missing): run it as root, e.g. with sudo"
    tools = [name for name in ("ip", "tc") if _tool(name) is None]
    if tools:
        return f"needs iproute2 ({' and '.join(tools)} not found): apt-get install iproute2"
    return None


def _run(args: Sequence[str], *, check: bool = True, timeout: float = 30) -> str:
    args = list(args)
    args[0] = _tool(args[0]) or args[0]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(args)}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def list_labs() -> dict[str, list[str]]:
    """Every lab on this machine: name -> its namespaces (found by the prefix)."""
    labs: dict[str, list[str]] = {}
    for line in _run(["ip", "netns", "list"]).splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(PREFIX):
            name = ns[len(PREFIX) :].rsplit("-", 1)[0]
            labs.setdefault(name, []).append(ns)
    return labs


def _namespace_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_in(namespaces: Sequence[str], grace: float = 2.0) -> None:
    """SIGTERM every process inside the namespaces, SIGKILL what is left after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = [pid for ns in namespaces for pid in _namespace_pids(ns) if pid != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_namespace_pids(ns) for ns in namespaces):
            time.sleep(0.05)


def remove_labs(name: str | None = None) -> list[str]:
    """Stop the processes inside and delete the namespaces of lab ``name`` (every lab when
    ``None``). Returns the namespaces removed."""
    labs = list_labs()
    doomed = [ns for lab, spaces in labs.items() if name in (None, lab) for ns in spaces]
    _kill_in(doomed)
    for ns in doomed:
        _run(["ip", "netns", "del", ns], check=False)
    left = [ns for spaces in list_labs().values() for ns in spaces if ns in doomed]
    if left:
        raise LabError(f"could not remove namespaces {', '.join(left)}: ip netns del {left[0]}")
    return doomed


@dataclasses.dataclass(frozen=True)
class NodeCounters:
    """Bytes and packets through a node's interface, read from the kernel's counters."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: NodeCounters) -> NodeCounters:
        return NodeCounters(*(a - b for a, b in zip(dataclasses.astuple(self),
                                                     dataclasses.astuple(other), strict=True)))  # fmt: skip


class Lab:
    """A lab network of ``nodes`` namespaces; a context manager that removes it on exit.

    Args:
        nodes: how many node namespaces (2 to 99).
        bandwidth: the cap of every node's link in bits per second or as text
            (``"1gbit"``); ``None``: uncapped (veth at CPU speed).
        slow: per-node caps that replace ``bandwidth`` for those nodes, ``{2: "100mbit"}``.
        name: the lab's name (lowercase letters and digits); its namespaces are
            ``mzlab-<name>-sw`` and ``mzlab-<name>-n<i>``.

    Example::

        with Lab(2, bandwidth="1gbit") as lab:
            lab.run(0, ["ping", "-c", "1", lab.address(1)])
    """

    def __init__(
        self,
        nodes: int,
        *,
        bandwidth: int | str | None = None,
        slow: Mapping[int, int | str] | None = None,
        name: str = "lab",
    ) -> None:
        if not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes}: a lab has 2 to {MAX_NODES} nodes")
        if not _NAME.match(name):
            raise ValueError(f"name {name!r}: use 1-12 lowercase letters and digits")
        self.nodes = nodes
        self.name = name
        rate = parse_rate(bandwidth, "bandwidth") if isinstance(bandwidth, str) else bandwidth
        self.caps: dict[int, int | None] = dict.fromkeys(range(nodes), rate)
        for node, cap in (slow or {}).items():
            if not 0 <= node < nodes:
                raise ValueError(f"slow node {node}: the lab has nodes 0 to {nodes - 1}")
            self.caps[node] = (
                parse_rate(cap, f"node {node}'s rate") if isinstance(cap, str) else cap
            )
        self.is_up = False

    # ---- names ----
    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.name}-sw"

    def namespace(self, node: int) -> str:
        self._check_node(node)
        return f"{PREFIX}{self.name}-n{node}"

    def address(self, node: int) -> str:
        self._check_node(node)
        return node_address(node)

    @property
    def ifname(self) -> str:
        return NODE_IFNAME

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node}: this lab has nodes 0 to {self.nodes - 1}")

    # ---- life cycle ----
    def up(self) -> Lab:
        """Build the lab (0.1-0.3 s); a lab of the same name must not exist."""
        why = missing_requirements()
        if why:
            raise LabError(why)
        if self.name in list_labs():
            raise LabExists(
                f"a lab named {self.name!r} exists: remove it with "
                f"'python -m trainers.netlab down --name {self.name}' or pick another --name"
            )
        try:
            self._build()
        except BaseException:
            with contextlib.suppress(LabError):
                remove_labs(self.name)
            raise
        self.is_up = True
        return self

    def _build(self) -> None:
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        self._quiet_ipv6(sw)
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0",
              "forward_delay", "0"])  # fmt: skip
        _run(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        for node in range(self.nodes):
            ns = self.namespace(node)
            port = f"port{node}"
            _run(["ip", "netns", "add", ns])
            self._quiet_ipv6(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", sw, "link", "add", port, "type", "veth",
                  "peer", "name", NODE_IFNAME, "netns", ns])  # fmt: skip
            _run(["ip", "-n", sw, "link", "set", port, "master", BRIDGE])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(node)}/{SUBNET_PREFIX}",
                  "dev", NODE_IFNAME])  # fmt: skip
            _run(["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"])
            cap = self.caps[node]
            if cap is not None:
                self._shape(ns, NODE_IFNAME, cap)
                self._shape(sw, port, cap)

    @staticmethod
    def _quiet_ipv6(ns: str) -> None:
        script = (
            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 && "
            "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"
        )
        _run(["ip", "netns", "exec", ns, "sh", "-c", f"[ ! -d /proc/sys/net/ipv6 ] || ({script})"])

    @staticmethod
    def _shape(ns: str, dev: str, rate: int) -> None:
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
              "burst", str(burst_bytes(rate)), "latency", f"{TBF_LATENCY_MS}ms"])  # fmt: skip

    def down(self) -> None:
        """Stop every process inside the lab and remove its namespaces."""
        remove_labs(self.name)
        self.is_up = False

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- using it ----
    def set_cap(self, node: int, rate: int | str | None) -> None:
        """Change a node's cap (both directions) while the lab runs; ``None`` removes it."""
        rate = parse_rate(rate, f"node {node}'s rate") if isinstance(rate, str) else rate
        ns, port = self.namespace(node), f"port{node}"
        if rate is None:
            _run(["tc", "-n", ns, "qdisc", "del", "dev", NODE_IFNAME, "root"], check=False)
            _run(["tc", "-n", self.switch, "qdisc", "del", "dev", port, "root"], check=False)
        else:
            self._shape(ns, NODE_IFNAME, rate)
            self._shape(self.switch, port, rate)
        self.caps[node] = rate

    def set_link(self, node: int, up: bool) -> None:
        """Pull (``up=False``) or plug back the cable of ``node`` at the switch."""
        self._check_node(node)
        _run(["ip", "-n", self.switch, "link", "set", f"port{node}", "up" if up else "down"])

    def exec_prefix(self, node: int) -> list[str]:
        """The argv prefix that runs a command inside ``node``'s namespace."""
        return [_tool("ip") or "ip", "netns", "exec", self.namespace(node)]

    def node_env(self, node: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment for a distributed process on ``node``: gloo and torchrun use the
        node's own interface and address."""
        env = dict(os.environ if base is None else base)
        env.update(GLOO_SOCKET_IFNAME=NODE_IFNAME, TP_SOCKET_IFNAME=NODE_IFNAME,
                   MODELZOO_NETLAB_NODE=str(node), MODELZOO_NETLAB_NODES=str(self.nodes))  # fmt: skip
        env["MODELZOO_NETLAB_CAPS"] = ",".join(
            "none" if cap is None else format_rate(cap) for cap in self.caps.values())  # fmt: skip
        return env

    def enable_control_host(self, address: str) -> None:
        """Give the bridge ``address``: the switch namespace becomes a host every node reaches
        without crossing another node's link (where a rendezvous store that must outlive any
        node runs)."""
        if ipaddress.ip_address(address) not in LAB_NETWORK:
            raise ValueError(f"{address}: lab addresses are in {LAB_NETWORK}")
        have = _run(["ip", "-n", self.switch, "-j", "addr", "show", BRIDGE])
        if address not in have:
            _run(["ip", "-n", self.switch, "addr", "add", f"{address}/{SUBNET_PREFIX}",
                  "dev", BRIDGE])  # fmt: skip

    def popen_switch(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in the switch namespace (the control host)."""
        return subprocess.Popen([_tool("ip") or "ip", "netns", "exec", self.switch, *argv],
                                **kwargs)  # fmt: skip

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (``subprocess.Popen`` keywords apply)."""
        return subprocess.Popen([*self.exec_prefix(node), *argv], **kwargs)

    def run(self, node: int, argv: Sequence[str], *, timeout: float = 60, check: bool = True,
            **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        proc = subprocess.run([*self.exec_prefix(node), *argv], timeout=timeout, **kwargs)
        if check and proc.returncode != 0:
            raise LabError(f"node {node}: {' '.join(argv)} exited with {proc.returncode}:\n"
                           f"{proc.stdout}{proc.stderr}")  # fmt: skip
        return proc

    def counters(self, node: int) -> NodeCounters:
        """The node's interface counters (what crossed its cable), from the kernel."""
        out = _run(["ip", "-n", self.namespace(node), "-s", "-j", "link", "show", NODE_IFNAME])
        stats = json.loads(out)[0]["stats64"]
        return NodeCounters(stats["tx"]["bytes"], stats["rx"]["bytes"],
                            stats["tx"]["packets"], stats["rx"]["packets"])  # fmt: skip

    def all_counters(self) -> list[NodeCounters]:
        return [self.counters(node) for node in range(self.nodes)]

    def describe(self) -> list[dict]:
        return describe(self.name)


def describe(name: str) -> list[dict]:
    """What the kernel says of lab ``name``: per node its address, cap, link and counters."""
    spaces = list_labs().get(name)
    if not spaces:
        raise LabError(f"no lab named {name!r} (labs here: {', '.join(list_labs()) or 'none'})")
    sw = f"{PREFIX}{name}-sw"
    ports = {}
    if sw in spaces:
        for link in json.loads(_run(["ip", "-n", sw, "-j", "link", "show"])):
            ports[link["ifname"]] = link
    rows = []
    nodes = sorted(int(ns.rsplit("-n", 1)[1]) for ns in spaces if re.search(r"-n\d+$", ns))
    for node in nodes:
        ns = f"{PREFIX}{name}-n{node}"
        row: dict = {"node": node, "namespace": ns}
        with contextlib.suppress(LabError, json.JSONDecodeError, IndexError, KeyError):
            link = json.loads(_run(["ip", "-n", ns, "-s", "-j", "addr", "show", NODE_IFNAME]))[0]
            row["address"] = next(a["local"] for a in link["addr_info"] if a["family"] == "inet")
        with contextlib.suppress(LabError, json.JSONDecodeError, IndexError, KeyError):
            stats = json.loads(_run(["ip", "-n", ns, "-s", "-j", "link", "show", NODE_IFNAME]))
            row["tx_bytes"] = stats[0]["stats64"]["tx"]["bytes"]
            row["rx_bytes"] = stats[0]["stats64"]["rx"]["bytes"]
        with contextlib.suppress(LabError, json.JSONDecodeError):
            qdiscs = json.loads(_run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", NODE_IFNAME]))
            tbf = [q for q in qdiscs if q.get("kind") == "tbf"]
            row["cap"] = format_rate(tbf[0]["options"]["rate"] * 8) if tbf else None
        port = ports.get(f"port{node}")
        row["link"] = "up" if port and "UP" in port.get("flags", []) else "down"
        row["processes"] = len(_namespace_pids(ns))
        rows.append(row)
    return rows
