"""The Ray cluster a run's env hosts live on: started here, joined, or inherited, and left as found.

Three ways in, one way out:

- ``local``: a cluster started in this process for this run, bound to
  127.0.0.1 only (Ray otherwise advertises and listens on the machine's
  external address even when asked for loopback), no dashboard, no usage
  statistics. :meth:`RayCluster.close` shuts it down, processes included.
- ``auto`` / ``host:port`` / ``ray://host:port``: an existing cluster is
  joined; :meth:`RayCluster.close` only disconnects (the actors this driver
  owns die with its job, the cluster stays).
- already connected (a job that ``hydra/launcher=ray`` runs inside a Ray
  worker): that connection is used and never closed here.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

#: what a user without the extra is told (one line, never a traceback)
INSTALL_HINT = "workers=ray needs the ray extra: pip install -e '.[ray]' (Ray >= 2.60)"


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached."""


def ray_installed() -> bool:
    """Whether the extra is installed, without importing Ray (its import fixes settings a local cluster needs)."""
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def import_ray() -> Any:
    """The ``ray`` module, imported with this project's defaults (usage stats off), or :class:`RayUnavailable`."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise RayUnavailable(INSTALL_HINT) from None
    return ray


@dataclass(frozen=True)
class NodeInfo:
    """One alive node of the cluster, as the plan prints it."""

    node_id: str
    address: str
    cpus: float
    resources: tuple[tuple[str, float], ...] = ()

    @property
    def label(self) -> str:
        """Short and stable enough for metric keys: the first 8 hex digits of the node id."""
        return self.node_id[:8]


#: seconds a host:port address gets to accept a TCP connection (ray.init itself retries for minutes)
REACH_TIMEOUT_S = 5.0


def _check_reachable(address: str) -> None:
    """Fail fast when ``[ray://]host:port`` accepts no connection; ``auto`` is Ray's own (quick) lookup."""
    import socket

    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=REACH_TIMEOUT_S).close()
    except ValueError:
        raise ConnectionError(f"no port in {address!r}") from None
    except OSError as err:
        raise ConnectionError(f"nothing accepts connections at {host}:{port} ({err.strerror or err})") from None


class RayCluster:
    """Connects to (or starts) the cluster named by ``address``; see the module docstring.

    ``runtime_env`` goes to ``ray.init`` (e.g. ``{"working_dir": "."}`` for
    nodes without this project installed); ``num_cpus`` and
    ``object_store_memory`` size a cluster started here.
    """

    def __init__(self, address: str = "local", *, num_cpus: int | None = None,
                 runtime_env: dict[str, Any] | None = None, object_store_memory: int | None = None) -> None:
        self.address = str(address)
        self.num_cpus = num_cpus
        self.runtime_env = dict(runtime_env or {})
        self.object_store_memory = object_store_memory
        self.mode: str | None = None  # started, joined or inherited once connected
        self.connect_s = 0.0

    def connect(self) -> RayCluster:
        if self.address == "local":
            # Ray's switch for single-machine clusters: every process advertises and binds 127.0.0.1.
            # Read when ray is imported, so it is set first (nothing here imports ray before connecting).
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray = import_ray()
        started = time.monotonic()
        if ray.is_initialized():
            self.mode = "inherited"
            return self
        kwargs: dict[str, Any] = {"include_dashboard": False, "configure_logging": False, "log_to_driver": True}
        if self.runtime_env:
            kwargs["runtime_env"] = self.runtime_env
        # ray.init installs its own SIGTERM handler in the driver; the runner's must stay in charge.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if self.address == "local":
                ray.init(address="local", num_cpus=self.num_cpus, object_store_memory=self.object_store_memory,
                         **kwargs)  # "local": a new cluster even when `ray start` left one on this machine
                self.mode = "started"
            else:
                _check_reachable(self.address)
                ray.init(address=self.address, **kwargs)
                self.mode = "joined"
        except (ConnectionError, RuntimeError, ValueError, TimeoutError, OSError) as err:
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RayUnavailable(f"ray.address={self.address!r}: cannot connect: {text}") from None
        finally:
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        self.connect_s = time.monotonic() - started
        return self

    def nodes(self) -> list[NodeInfo]:
        """The alive nodes, in the order Ray lists them."""
        ray = import_ray()
        out = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources", {})
            custom = tuple(sorted((k, float(v)) for k, v in res.items()
                                  if k not in ("CPU", "GPU", "memory", "object_store_memory")
                                  and not k.startswith("node:") and not k.startswith("accelerator_type")))
            out.append(NodeInfo(str(node["NodeID"]), str(node.get("NodeManagerAddress", "?")),
                                float(res.get("CPU", 0.0)), custom))
        return out

    def total_cpus(self) -> float:
        return sum(n.cpus for n in self.nodes())

    def describe(self) -> str:
        """One line for the plan: how this run reached the cluster and what it holds."""
        nodes = self.nodes()
        how = {"started": "started here (127.0.0.1 only, shut down at exit)",
               "joined": f"joined {self.address} (left running at exit)",
               "inherited": "the Ray job this run is part of (hydra/launcher=ray)"}.get(self.mode or "", "?")
        return f"{how}; {len(nodes)} node(s), {sum(n.cpus for n in nodes):g} CPU(s)"

    def close(self) -> None:
        """Shut down a cluster started here, disconnect from a joined one, leave an inherited one alone."""
        if self.mode in ("started", "joined"):
            import_ray().shutdown()
        self.mode = None
