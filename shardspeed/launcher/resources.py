"""Which hosts and slots a job uses: ``--include``/``--exclude``, ``--num_nodes``, ``--num_gpus``.

Filters use DeepSpeed's syntax ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT
...]]``: ``-i "worker-0@worker-1:0,2"`` keeps all of worker-0 and slots 0 and 2 of worker-1;
``-e "worker-1:0"`` drops slot 0 of worker-1 and keeps the rest. A name without slots means the
whole host. The result keeps hostfile order (which is node-rank order) and sorted slot ids.
"""

from __future__ import annotations

import os
import re

NODE_SEP = "@"
SLOT_LIST_START = ":"
SLOT_SEP = ","

Resources = dict[str, list[int]]

_FORMAT_HINT = "use NAME[:SLOT[,SLOT...]] joined by '@', e.g. \"worker-0@worker-1:0,2\""


def _parse_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """``{host: slots or None for the whole host}`` from one filter string. A host named more
    than once gets the union of its entries (DeepSpeed merges them too)."""
    parsed: dict[str, list[int] | None] = {}
    for node_spec in spec.split(NODE_SEP):
        node_spec = node_spec.strip()
        if not node_spec:
            raise ValueError(f"{flag} {spec!r} has an empty node entry; {_FORMAT_HINT}")
        host, has_slots, slot_text = node_spec.partition(SLOT_LIST_START)
        if not host:
            raise ValueError(f"{flag} {spec!r}: {node_spec!r} has no host name; {_FORMAT_HINT}")
        slots: list[int] | None = None
        if has_slots:
            slots = []
            for token in slot_text.split(SLOT_SEP):
                token = token.strip()
                if not token.isdigit():
                    raise ValueError(
                        f"{flag} {spec!r}: slot {token!r} of host {host!r} is not a "
                        f"non-negative integer; {_FORMAT_HINT}"
                    )
                slots.append(int(token))
        if host in parsed:
            earlier = parsed[host]
            slots = None if earlier is None or slots is None else earlier + slots
        parsed[host] = None if slots is None else sorted(set(slots))
    return parsed


def _check_known(pool: Resources, wanted: dict[str, list[int] | None], flag: str) -> None:
    for host, slots in wanted.items():
        if host not in pool:
            known = ", ".join(pool) or "none"
            raise ValueError(
                f"{flag}: host {host!r} is not in the hostfile (known hosts: {known}); "
                "fix the name or add the host to the hostfile"
            )
        for slot in slots or []:
            if slot not in pool[host]:
                raise ValueError(
                    f"{flag}: host {host!r} has no slot {slot} (it has slots "
                    f"{_ranges(pool[host])}); pick slots from that list"
                )


def _ranges(slots: list[int]) -> str:
    return ",".join(str(s) for s in slots) if slots else "none"


def parse_resource_filter(
    host_info: Resources, include_str: str = "", exclude_str: str = ""
) -> Resources:
    """Apply an include or exclude filter to ``host_info`` (``{host: [slot ids]}``).

    DeepSpeed's function and keywords. An exclude may leave nothing (``{}``), as in DeepSpeed;
    :func:`select_resources` refuses that for a launch. Raises ``ValueError`` when both filters
    are given, for malformed filters and for unknown hosts or slots.
    """
    if include_str and exclude_str:
        raise ValueError(
            "--include and --exclude are mutually exclusive; keep one of them (list what to "
            "use with --include, or what to skip with --exclude)"
        )
    if not include_str and not exclude_str:
        return {host: sorted(slots) for host, slots in host_info.items()}
    if include_str:
        wanted = _parse_filter(include_str, "--include")
        _check_known(host_info, wanted, "--include")
        chosen = {h: sorted(host_info[h] if s is None else s) for h, s in wanted.items()}
    else:
        dropped = _parse_filter(exclude_str, "--exclude")
        _check_known(host_info, dropped, "--exclude")
        chosen = {}
        for host, slots in host_info.items():
            gone = dropped.get(host, [])
            if host in dropped and gone is None:
                continue
            chosen[host] = sorted(s for s in slots if s not in (gone or []))
    return {host: chosen[host] for host in host_info if chosen.get(host)}


def parse_inclusion_exclusion(
    resource_pool: dict[str, int], inclusion: str = "", exclusion: str = ""
) -> Resources:
    """Slot counts from a hostfile, filtered: ``{"a": 2}`` with ``-e a:0`` gives ``{"a": [1]}``."""
    pool = {host: list(range(count)) for host, count in resource_pool.items()}
    return parse_resource_filter(pool, inclusion, exclusion)


def limit_resources(active: Resources, num_nodes: int = -1, num_gpus: int = -1) -> Resources:
    """Keep the first ``num_nodes`` hosts and the first ``num_gpus`` selected slots of each.

    Values <= 0 mean "no limit". Asking for more nodes or slots than are selected is an error
    rather than a silently smaller (or larger) job.
    """
    hosts = list(active)
    if num_nodes > 0:
        if num_nodes > len(hosts):
            raise ValueError(
                f"--num_nodes {num_nodes} but only {len(hosts)} host(s) are available "
                f"({', '.join(hosts)}); lower --num_nodes or add hosts to the hostfile"
            )
        hosts = hosts[:num_nodes]
    limited: Resources = {}
    for host in hosts:
        slots = active[host]
        if num_gpus > 0:
            if num_gpus > len(slots):
                raise ValueError(
                    f"--num_gpus {num_gpus} but host {host!r} has only {len(slots)} selected "
                    f"slot(s) ({_ranges(slots)}); lower --num_gpus or fix the hostfile"
                )
            slots = slots[:num_gpus]
        limited[host] = list(slots)
    return limited


def select_resources(
    resource_pool: dict[str, int],
    include: str = "",
    exclude: str = "",
    num_nodes: int = -1,
    num_gpus: int = -1,
) -> Resources:
    """The active ``{host: [slot ids]}``: filters first, then the node and slot limits.
    Raises ``ValueError`` when the filter leaves nothing to run on."""
    active = parse_inclusion_exclusion(resource_pool, include, exclude)
    if not active:
        flag = "--include" if include else "--exclude"
        raise ValueError(f"{flag} leaves no host or slot to run on; relax the filter")
    return limit_resources(active, num_nodes, num_gpus)


def _installed_nvidia_gpus() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    # some containers expose the device nodes but not the driver's /proc entries
    try:
        return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
    except OSError:
        return 0


def local_accelerator_count() -> int | None:
    """How many NVIDIA GPUs this node can use, found without importing torch; ``None`` for CPU.

    ``DS_ACCELERATOR=cpu`` forces CPU. The driver's ``/proc/driver/nvidia/gpus`` entries (or
    ``/dev/nvidiaN`` nodes) are counted, capped by ``CUDA_VISIBLE_DEVICES`` when it is set (empty or ``-1`` hides all).
    """
    forced = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if forced == "cpu":
        return None
    installed = _installed_nvidia_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in re.split(r"[,\s]+", visible.strip()) if v]
        # CUDA stops at the first invalid id; "-1" is the usual way to hide every GPU
        ids = ids[: ids.index("-1")] if "-1" in ids else ids
        installed = min(installed, len(ids))
    return installed or None
