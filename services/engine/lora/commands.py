"""Loading and unloading adapters in a running engine: the commands the server sends its
engine core, and what each answers (an HTTP status the server returns as it is).

``load``: a name the engine has under the same path answers 200 and changes nothing (the
gateway's fan-out and the Redis registry's sync may both deliver one load); under another path
it is a 409 (unload it first). A runtime load's path is confined to the adapter roots
(``paths.AdapterRoots``) before anything is opened; a refused adapter is a 400 naming the field
or module. ``unload``: 200, or 404 for a name the engine does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.lora.manager import RUNTIME, AdapterState, LoRAManager
from services.engine.lora.paths import AdapterRoots
from services.protocol.wire import BadRequest

LOAD, UNLOAD = "load", "unload"


@dataclass(slots=True)
class AdapterCommand:
    op: str  # LOAD or UNLOAD
    name: str
    path: str = ""
    roots: tuple[str, ...] = ()  # the server's --lora-roots
    reply_to: int = 0  # the server's id for the answer


@dataclass(slots=True)
class AdapterReply:
    reply_to: int
    status: int  # 200, 400, 404 or 409
    message: str
    param: str | None = None
    adapter: AdapterState | None = None


def run(manager: LoRAManager | None, cmd: AdapterCommand) -> AdapterReply:
    """Applies ``cmd`` (the engine thread)."""
    if manager is None:
        return AdapterReply(cmd.reply_to, 400, "this engine serves no LoRA adapters (start it "
                            "with --enable-lora)", "lora_name")
    if cmd.op == UNLOAD:
        if manager.unload(cmd.name):
            return AdapterReply(cmd.reply_to, 200, f"adapter {cmd.name!r} unloaded")
        return AdapterReply(cmd.reply_to, 404, f"the adapter {cmd.name!r} is not loaded",
                            "lora_name")
    entry = manager.registered.get(cmd.name)
    if entry is not None:
        if entry.path != cmd.path:
            return AdapterReply(cmd.reply_to, 409, f"the adapter {cmd.name!r} is already "
                                f"loaded from {entry.path!r}", "lora_name")
        return AdapterReply(cmd.reply_to, 200, "already loaded", adapter=_state(manager,
                                                                                 cmd.name))
    roots = AdapterRoots(cmd.roots)
    try:
        directory = roots.resolve(cmd.path)
        manager.load(cmd.name, cmd.path, RUNTIME, confine=roots.confine,
                     directory=directory)
    except BadRequest as exc:
        return AdapterReply(cmd.reply_to, 400, str(exc), exc.param)
    return AdapterReply(cmd.reply_to, 200, f"adapter {cmd.name!r} loaded",
                        adapter=_state(manager, cmd.name))


def _state(manager: LoRAManager, name: str) -> AdapterState:
    return next(s for s in manager.states() if s.name == name)
