"""For the scripts run under llama-cpp-python (never ember): llama.cpp's plain CPU
buffers instead of its extra buffer types (AMX, the x8 repack), which crash its LoRA
path ("cannot use buft 'AMX'") and its embedding decode on an AMX machine; plain
buffers compute the same."""

import llama_cpp


def use_plain_buffers() -> None:
    """Every model loaded after this call gets plain buffers."""
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def plain_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = plain_buffers
