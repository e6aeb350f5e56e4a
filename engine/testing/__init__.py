"""Tiny random-weight models and GGUF files that the tests, the GPU check and the scripts build on: real computations
in seconds, with every parameter a real file has."""
