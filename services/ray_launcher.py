"""``epd ray up``: the gateways and both pools as Ray actors.

Each actor serves its role in-process, exactly as ``epd serve ROLE`` does, and the workers
register with every gateway by heartbeat (``--gateways N``: each worker's ``--gateway`` lists
all their registries) — the same path as on Kubernetes, so no gateway needs a list of
addresses. Actors are restarted by Ray when they die (``max_restarts``); a restarted
worker registers again and the gateway takes it back. Resources per role are flags
(``--encoder-gpus`` etc.). On an existing cluster (``--address``) the actors are detached and
named in the ``epd`` namespace, so they outlive this command; locally the command keeps the
cluster up until Ctrl-C (``--once``: send the demo request, then tear everything down).

Placement: a local cluster gets as many logical CPUs as the actors ask for when the machine has
fewer (Ray's CPUs are scheduling slots; the roles' compute threads are set on their own), so the
defaults start on any machine. While actors are not ready, every ``PLACEMENT_REPORT_S`` their
requests are checked against the cluster's nodes: what cannot be placed is reported with what
it asks for and what the cluster has, and a local cluster fails the command at once instead of
waiting (an existing cluster keeps waiting: its autoscaler may add nodes).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from dataclasses import dataclass

from common.allocator import find_tcmalloc, with_allocator
from common.heap import freeze_startup_heap

NAMESPACE = "epd"
GATEWAY_CPUS = 0.1
PLACEMENT_REPORT_S = 5.0  # an actor not placed by then is reported, and again this often


@dataclass(frozen=True)
class Need:
    """One actor and the resources it asks Ray for."""

    name: str
    cpus: float
    gpus: float

    def fits(self, resources: dict) -> bool:
        # NOTE: a small tolerance: Ray keeps fractional resources in fixed point
        return (
            resources.get("CPU", 0.0) + 1e-6 >= self.cpus
            and resources.get("GPU", 0.0) + 1e-6 >= self.gpus
        )

    def describe(self) -> str:
        gpus = f", {self.gpus:g} GPU" if self.gpus else ""
        return f"{self.name} ({self.cpus:g} CPU{gpus})"


def local_cpus(args: argparse.Namespace, machine_cpus: int) -> int:
    """Logical CPUs of a local cluster: ``--num-cpus``, else enough for every actor (at least
    the machine's)."""
    if args.num_cpus is not None:
        return args.num_cpus
    asked = (
        args.gateways * GATEWAY_CPUS
        + args.encoders * args.encoder_cpus
        + args.languages * args.language_cpus
    )
    return max(machine_cpus, math.ceil(asked - 1e-9))


def placement_problem(needs: list[Need], nodes: list[dict]) -> tuple[str, bool]:
    """Why some of ``needs`` (every actor this command started) cannot all be placed on
    ``nodes`` (each node's total resources), or "" when they fit; and whether it is for good
    (an actor larger than any node, or more than all nodes together: only more nodes help)."""
    total = {k: sum(n.get(k, 0.0) for n in nodes) for k in ("CPU", "GPU")}
    too_big = [n for n in needs if not any(n.fits(node) for node in nodes)]
    asked = Need("all", sum(n.cpus for n in needs), sum(n.gpus for n in needs))
    if not too_big and asked.fits(total):
        return "", False
    have = f"{total['CPU']:g} CPU and {total['GPU']:g} GPU on {len(nodes)} node(s)"
    if too_big:
        what = f"{', '.join(n.describe() for n in too_big)} larger than any node"
    else:
        what = f"the actors ask for {asked.cpus:g} CPU and {asked.gpus:g} GPU in all"
    message = (
        f"cannot place every actor: {what}; the cluster has {have}. Lower --encoder-cpus / "
        "--language-cpus (or the GPUs), or give the cluster more (--num-cpus locally, more "
        "nodes on a cluster)"
    )
    return message, True


class ServiceActor:
    """Runs one role in the actor's process. ``address()`` is where its gRPC server listens."""

    def __init__(self, role: str, argv: list[str], on_cluster: bool) -> None:
        from services.serve import ROLE_MODULES

        self.role = role
        self.host = "127.0.0.1"
        if on_cluster:  # listen on every interface, advertise the node's address
            import ray

            self.host = ray.util.get_node_ip_address()
            argv = [*argv, "--host", "0.0.0.0"]
            if role != "gateway":
                argv += ["--advertise-host", self.host, "--transfer-host", self.host]
        self._running = self._start(ROLE_MODULES[role], argv)
        freeze_startup_heap()  # as ``epd serve`` does (common.heap)
        self.port = self._running.port
        self.registry_port = self._running.registry_port

    @staticmethod
    def _start(module_name: str, argv: list[str]):
        import importlib

        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        return module.start(parser.parse_args(argv))

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def registry_address(self) -> str:
        """The gateway's worker registry (internal port); workers register there."""
        return f"{self.host}:{self.registry_port}"

    def stop(self) -> None:
        """Drain as ``epd serve`` does on SIGTERM (leave the gateways, finish the work in
        flight, up to the role's drain timeout), then stop."""
        running = self._running
        if running.drain is not None and running.drain_timeout_s > 0:
            running.drain(time.monotonic() + running.drain_timeout_s)
        running.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from common.models.tiny import ARCHS, DEFAULT_ARCH

    parser.add_argument("action", choices=["up"], help="start the stack")
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    parser.add_argument("--gateways", type=int, default=1, help="gateway actors")
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--languages", type=int, default=1)
    parser.add_argument("--model-path", help="checkpoint visible on every node (default: demo)")
    parser.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH)
    parser.add_argument(
        "--gateway-port", type=int, default=50051, help="the first gateway's public port"
    )
    parser.add_argument(
        "--registry-port",
        type=int,
        default=0,
        help="the first gateway's worker registry port (0: a free one; other gateways: free)",
    )
    parser.add_argument("--encoder-cpus", type=float, default=1.0)
    parser.add_argument("--encoder-gpus", type=float, default=0.0)
    parser.add_argument("--language-cpus", type=float, default=1.0)
    parser.add_argument("--language-gpus", type=float, default=0.0)
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="restarts of a dead actor (-1: forever)"
    )
    parser.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="logical CPUs of the local cluster (default: enough for every actor, at least "
        "the machine's)",
    )
    parser.add_argument("--once", action="store_true", help="send the demo request, then stop")
    parser.add_argument("--startup-timeout", type=float, default=300.0)


def _actor_options(
    args, role: str, cpus: float, gpus: float, index: int, env_vars: dict[str, str]
) -> dict:
    """``env_vars``: the job's; the actor starts with tcmalloc preloaded on top
    (``common/allocator.py``; Ray starts the actor's process, so ``epd serve``'s restart has no part
    here), found where the driver finds it: the nodes run one image."""
    options = {
        "num_cpus": cpus,
        "num_gpus": gpus,
        "max_restarts": args.max_restarts,
        "max_concurrency": 4,
    }
    preloaded = with_allocator(os.environ, find_tcmalloc())
    if preloaded is not None:  # (None: no tcmalloc, or the operator's own LD_PRELOAD)
        options["runtime_env"] = {"env_vars": {**env_vars, "LD_PRELOAD": preloaded["LD_PRELOAD"]}}
    if args.address:
        options.update(name=f"{role}-{index}", namespace=NAMESPACE, lifetime="detached")
    return options


def _placed_results(ray, refs: list, needs: list[Need], args, on_cluster: bool) -> list:
    """``ray.get(refs)`` within ``--startup-timeout``. While some are not ready, every
    ``PLACEMENT_REPORT_S`` the actors started so far (``needs``) are checked against the
    cluster's nodes: what cannot be placed is reported, and locally ends the command at once
    (``SystemExit`` with the reason); on a cluster it waits (an autoscaler may add nodes)."""
    deadline = time.monotonic() + args.startup_timeout
    pending = set(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"{len(pending)} actor(s) not started within --startup-timeout "
                             f"{args.startup_timeout:g} s")  # fmt: skip
        ready, _ = ray.wait(list(pending), num_returns=len(pending),
                            timeout=min(PLACEMENT_REPORT_S, left))  # fmt: skip
        pending -= set(ready)
        if not pending:
            break
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        message, for_good = placement_problem(needs, nodes)
        if message:
            print(message, flush=True)
            if for_good and not on_cluster:
                raise SystemExit(message)
    return ray.get(refs)


def run(args: argparse.Namespace) -> int:
    import ray

    from common.models.tiny import ensure_tiny_model
    from common.registration import wait_for_workers
    from services.launcher import run_demo

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    model_path = args.model_path or str(ensure_tiny_model(args.arch, "demo"))
    runtime_env = {"env_vars": {"GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "2")}}
    if args.address:
        ray.init(address=args.address, namespace=NAMESPACE, runtime_env=runtime_env)
    else:
        num_cpus = local_cpus(args, os.cpu_count() or 1)
        if num_cpus > (os.cpu_count() or 1) and args.num_cpus is None:
            print(f"local Ray cluster: {num_cpus} logical CPUs for the actors on a "
                  f"{os.cpu_count()}-CPU machine", flush=True)  # fmt: skip
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            namespace=NAMESPACE,
            object_store_memory=256 << 20,
            runtime_env=runtime_env,
        )
    on_cluster = bool(args.address)
    actor_cls = ray.remote(ServiceActor)
    actors = []
    needs: list[Need] = []
    try:
        for i in range(args.gateways):
            first = i == 0
            ports = (args.gateway_port, args.registry_port) if first else (0, 0)
            argv = ["--port", str(ports[0]), "--registry-port", str(ports[1])]
            options = _actor_options(args, "gateway", GATEWAY_CPUS, 0, i, runtime_env["env_vars"])
            actors.append(actor_cls.options(**options).remote("gateway", argv, on_cluster))
            needs.append(Need(f"gateway-{i}", GATEWAY_CPUS, 0.0))
        gateways = actors[: args.gateways]
        gateway_addresses = _placed_results(
            ray, [g.address.remote() for g in gateways], needs, args, on_cluster
        )
        registry_addresses = ray.get(
            [g.registry_address.remote() for g in gateways], timeout=args.startup_timeout
        )
        for gateway_address, registry_address in zip(
            gateway_addresses, registry_addresses, strict=True
        ):
            print(f"gateway actor on {gateway_address} (registry {registry_address})", flush=True)
        worker_argv = ["--model-path", model_path, "--port", "0"]
        worker_argv += ["--gateway", ",".join(registry_addresses)]
        for role, count, cpus, gpus in (
            ("encoder", args.encoders, args.encoder_cpus, args.encoder_gpus),
            ("language", args.languages, args.language_cpus, args.language_gpus),
        ):
            for i in range(count):
                actors.append(
                    actor_cls.options(
                        **_actor_options(args, role, cpus, gpus, i, runtime_env["env_vars"])
                    ).remote(role, worker_argv, on_cluster)
                )
                needs.append(Need(f"{role}-{i}", cpus, gpus))
        workers = actors[args.gateways :]
        addresses = _placed_results(
            ray, [a.address.remote() for a in workers], needs, args, on_cluster
        )
        print("workers: " + ", ".join(addresses), flush=True)
        for registry_address in registry_addresses:
            wait_for_workers(registry_address, args.encoders, args.languages, args.startup_timeout)
        ok = run_demo(gateway_addresses, max_tokens=16)
        if args.once:
            return 0 if ok else 1
        if args.address:
            print("actors are detached in namespace 'epd'; this command can exit", flush=True)
            return 0
        print(f"serving on {', '.join(gateway_addresses)} (Ctrl-C to stop)", flush=True)
        while True:
            signal.pause()  # nothing to do until Ctrl-C (its KeyboardInterrupt ends the wait)
    except KeyboardInterrupt:
        return 0
    finally:
        if args.once or not args.address:
            for actor in reversed(actors):
                try:
                    ray.get(actor.stop.remote(), timeout=60)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
                ray.kill(actor)
            ray.shutdown()
