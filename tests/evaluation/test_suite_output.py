"""The evaluation suite file is data: it runs no command; tools/evaluate.py's --output folder holds
one run's results only."""

from __future__ import annotations

import pytest
import yaml

from mmssl.evaluation.suite import SuiteError, load_suite


@pytest.mark.parametrize("key, spec", [
    ("test", "pipe:touch {ran}; cat {tar}"),
    ("train", "{tar}::pipe:touch {ran}"),
    ("classnames", "{{pipe:touch {ran},x}}"),
])
def test_a_pipe_source_in_a_suite_file_is_refused_naming_the_file_and_key(tmp_path, key, spec):
    ran = tmp_path / "ran"
    tar = tmp_path / "0.tar"
    tar.write_bytes(b"")
    entry = {"test": str(tmp_path), "train": str(tmp_path), "tasks": ["knn"]}  # loads whole but for the pipe:
    entry[key] = spec.format(ran=ran, tar=tar)
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"sets": {"a": entry}}))
    with pytest.raises(SuiteError, match=rf"{suite}: sets\.a\.{key}: .*pipe: source, which runs a shell command"):
        load_suite(str(suite))
    assert not ran.exists()
