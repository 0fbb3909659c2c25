"""The warning for torchrun restarts that reuse the rendezvous's store with a process group made before the
plugin was imported."""

from __future__ import annotations

from collections.abc import Mapping


def elastic_store_warning(env: Mapping[str, str]) -> str | None:
    """The line to warn with where torchrun may restart these workers (``--max-restarts`` above 0) with the
    rendezvous's shared TCPStore (torch's default) and their process group was made in it, before the plugin was
    imported (``transports.elastic_store`` gives each round a store of its own otherwise): the restarted process
    group's keys are the same as the dead one's, still in that store, so a rank can read a dead rank's gloo
    address and retry it until the process group's timeout (``Gloo connectFullMesh failed ... Connection
    refused``). None where torchrun does not restart with that store."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None
    return (
        "ds_tensorshard: torchrun may restart these workers with the store of the previous round (the rendezvous's "
        "shared TCPStore), and the process group was made before ds_tensorshard was imported: a restarted process "
        "group can read a dead rank's address from it and fail after its timeout ('Gloo connectFullMesh failed ... "
        "Connection refused'); import ds_tensorshard before the process group is made (or run the script with "
        "python -m ds_tensorshard), or start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a new store each "
        "round; docs/cluster.md, Elastic training)"
    )
