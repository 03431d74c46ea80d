import pytest

from partialbayes.glue_bench import __version__
from partialbayes.glue_bench.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out
