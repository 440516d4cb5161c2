# Sourced by the bench/h200_*.sh scripts: install the carried wheels ($C/wheels: mlx-cuda-13, mlx,
# mlx-lm, gguf) into /tmp/site once per machine (the device reaches no package registry).
python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import mlx.core" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$C"/wheels/*.whl
