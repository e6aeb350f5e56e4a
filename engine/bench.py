"""`python -m engine.bench`, the documented name of the benchmark command (engine/tools/bench.py)."""
from .tools.bench import main

if __name__ == "__main__":
    main()
