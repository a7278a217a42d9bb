"""The licence the README and pyproject.toml name is the one the repository ships, in full."""

import hashlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APACHE_2_0_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"  # https://www.apache.org/licenses/LICENSE-2.0.txt, unchanged


def test_the_license_file_is_apache_2_0_in_full_as_pyproject_and_the_readme_say():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.md5(text).hexdigest() == APACHE_2_0_MD5
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    assert "[Apache-2.0](LICENSE)" in (ROOT / "README.md").read_text()
