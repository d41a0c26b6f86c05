"""The LoRA adapters a server serves, by name: which tenants may use each, what a
request's ``model`` names, and loading and unloading them at run time (the admin routes;
paths only under ``--lora-dir``, or absolute). Which adapters are resident in memory is
the engine's business (:class:`~ember.engine.adapters.LoRARegistry`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.server.backend import EngineView
from ember.server.config import ServerConfig
from ember.server.errors import APIError


class ServedAdapters:
    """``engine()``: the served engine (once loaded); ``model_names()``: the base model's
    names, which no adapter may take."""

    def __init__(self, config: ServerConfig, engine: Callable[[], EngineView],
                 model_names: Callable[[], list[str]]) -> None:
        self.lora_dir = config.lora_dir
        self.engine, self.model_names = engine, model_names
        # by name: the tenants that may use each (None: every one)
        self._allowed: dict[str, frozenset[str] | None] = {}

    def allow(self, name: str, tenants: frozenset[str] | None) -> None:
        self._allowed[name] = tenants

    def check_model(self, model: str | None, tenant: str) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model; Ollama's ``:latest``
        tag may follow a name). An unknown name and an adapter the tenant may not use get
        the same 404: existence does not leak."""
        if model is not None:
            model = model.removesuffix(":latest")  # Ollama's default tag names the same
        if model is None or model in self.model_names():
            return None
        if model in self.for_tenant(tenant):
            return model
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                         f"'{self.model_names()[0]}'", param="model", code="model_not_found")

    def for_tenant(self, tenant: str) -> list[str]:
        """The adapters ``tenant`` may use, by name."""
        return [name for name, allowed in list(self._allowed.items())
                if allowed is None or tenant in allowed]

    def path(self, raw: str) -> str:
        """The file a request's ``lora_path`` names: under ``--lora-dir`` when the server
        has one (a relative path resolves against it; nothing outside it, through a
        symlink either), else an absolute path (never the server's working directory)."""
        path = Path(raw)
        if self.lora_dir is None:
            if not path.is_absolute():
                raise APIError(400, "'lora_path' must be an absolute path (or the server "
                               "started with --lora-dir DIR, and a path under DIR)",
                               param="lora_path")
            return raw
        root = Path(self.lora_dir).resolve()
        full = (root / path).resolve()
        if not full.is_relative_to(root):
            raise APIError(400, "'lora_path' must name a file under the server's --lora-dir",
                           param="lora_path")
        return str(full)

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        """Runs on the admin thread (reading an adapter takes a while)."""
        name, path = _text_field(body, "lora_name"), _text_field(body, "lora_path")
        path = self.path(path)
        tenants = body.get("tenants")
        if tenants is not None and not (isinstance(tenants, list)
                                        and all(isinstance(t, str) for t in tenants)):
            raise APIError(400, "'tenants' must be a list of tenant names", param="tenants")
        if name in self.model_names():
            raise APIError(400, f"'lora_name' {name!r} is the base model's name",
                             param="lora_name")
        try:
            adapter = self.engine().load_lora(name, path)
        except EmberError as e:
            raise APIError(400, f"cannot load the LoRA adapter: {e}", param="lora_path") from None
        self.allow(name, None if tenants is None else frozenset(tenants))
        return {"lora_name": name, "rank": adapter.rank, "targets": adapter.targets,
                "bytes": adapter.nbytes}

    def unload(self, body: dict[str, Any]) -> dict[str, Any]:
        name = _text_field(body, "lora_name")
        if self._allowed.pop(name, 0) == 0:
            raise APIError(404, f"no LoRA adapter '{name}' is loaded", param="lora_name",
                             code="model_not_found")
        self.engine().unload_lora(name)  # requests running with it finish with it
        return {"lora_name": name, "unloaded": True}


def _text_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{name}' must be a non-empty string", param=name)
    return value
