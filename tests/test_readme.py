"""The README's SDK example runs as written against a real daemon."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_sdk_example_runs(daemon):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "kvstore_client.connect(" in b)
    assert '"data/kvstore.sock"' in example
    code = example.replace('"data/kvstore.sock"', repr(str(daemon.socket)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
