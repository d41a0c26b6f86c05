"""The model an engine serves, as its config asks: chat template, KV dtype, drift."""

from __future__ import annotations

import dataclasses

from ember.chat_template import ChatTemplate, ChatTemplateError
from ember.config import EngineConfig, InvalidConfig
from ember.kv.blocks import KV_DTYPES
from ember.models.loader import LoadedModel
from ember.models.validation import check_drift, model_sha


def served_model(config: EngineConfig, loaded: LoadedModel) -> LoadedModel:
    """The model as this config serves it: its chat template replaced where the config
    gives one; refused when the KV dtype does not fit its heads or its recorded drift
    crosses the limits."""
    if config.chat_template is not None:
        loaded = with_chat_template(loaded, config.chat_template)
    cfg = loaded.config
    kv_dtype = KV_DTYPES[config.kv_dtype]
    if not kv_dtype.fits(cfg.head_dim):
        raise InvalidConfig(
            f"kv_dtype {config.kv_dtype!r} stores each head's row in blocks of "
            f"{kv_dtype.block} values, but {loaded.path.name} has head_dim "
            f"{cfg.head_dim}, not a multiple of {kv_dtype.block}: choose another kv_dtype")
    if not config.allow_drift:
        why = check_drift(model_sha(loaded), loaded.weights, config.kv_dtype)
        if why is not None:
            raise InvalidConfig(why)
    return loaded


def with_chat_template(loaded: LoadedModel, source: str) -> LoadedModel:
    """The model with a chat template given as text (with the model's BOS/EOS texts)
    in place of its own: a copy, so a shared LoadedModel stays as it was."""
    old, tok = loaded.chat_template, loaded.tokenizer

    def text(token: int | None) -> str:
        return "" if token is None else tok.token_bytes(token).decode("utf-8", "replace")

    try:
        template = ChatTemplate(source, bos_token=old.bos_token if old else text(tok.bos_id),
                                eos_token=old.eos_token if old else text(tok.eos_id))
    except ChatTemplateError as e:
        raise InvalidConfig(f"chat_template: {e}") from None
    return dataclasses.replace(loaded, chat_template=template)


