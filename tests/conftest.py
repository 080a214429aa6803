import os

import pytest
from hypothesis import settings

# Property tests: thorough in CI, quick while iterating (RTP_HYPOTHESIS_PROFILE=dev).
settings.register_profile("ci", max_examples=150, deadline=None)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("RTP_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def default_gguf():
    """Path of rtp's default model (SmolLM2-135M-Instruct Q4_1 GGUF), fetched once into $RTP_HOME."""
    from rtp.checkpoint.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(default_gguf):
    """transformers' own fp32 load of the default GGUF (it dequantizes with the gguf package and
    undoes the q/k permutation): the reference for tensors and greedy tokens. Loaded once per
    session (about 20 s); tests that need it in another dtype deep-copy it."""
    transformers = pytest.importorskip("transformers")
    import torch

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32)
    return model.eval()
