import os
import sys

# Tests import shared builders as `from helpers import ...`.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
