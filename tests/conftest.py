"""Every test runs on 8 virtual CPU devices, configured before TF starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tfpar  # noqa: E402

tfpar.use_virtual_cpus(8)
