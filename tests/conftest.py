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
    from rtp.engine.default_model import default_model_path

    return default_model_path()
