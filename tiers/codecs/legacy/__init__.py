"""Decoders of payload versions no longer written: lossy v3 (lossy_v3.py, with its compiled
kernels). Stored blocks of these versions still decode; their encoders stay for the tests that
make such payloads. The lossless v1 decoder is a few lines inside lossless.py."""
