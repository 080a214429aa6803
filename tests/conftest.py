import os

from hypothesis import settings

# Property tests: thorough in CI, quick while iterating (RTP_HYPOTHESIS_PROFILE=dev).
settings.register_profile("ci", max_examples=150, deadline=None)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("RTP_HYPOTHESIS_PROFILE", "ci"))
