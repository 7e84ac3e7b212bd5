"""Schedule benchmarks (issue 5): emulated-device and real-compute runs; see benchmarks/README.md."""
