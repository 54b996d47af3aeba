"""What a :class:`SlurmCluster` writes into its batch script: every option on its own
``#SBATCH`` line, quoted where it must be, and nothing that could end that line.

The job itself runs in ``tests/test_cluster.py`` (a space in the job name and in the job's
directory, on the loopback Slurm cluster); here, what is refused before anything is written
or submitted, and how options are quoted.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import SlurmCluster
from notebook_launcher._launch import slurm

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SHELL = "debug\ntouch /tmp/pwned"


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"partition": SHELL}, "partition="),
        ({"job_name": "nl\ntouch F"}, "job_name="),
        ({"account": "a\rb"}, "account="),
        ({"time": "10\n#SBATCH --x"}, "time="),
        ({"qos": "q\x00"}, "qos="),
        ({"mem": "1G\x1b"}, "mem="),
        ({"constraint": "c\tx"}, "constraint="),
        ({"sbatch_options": ["--exclusive", "--comment=a\nrm -rf ~"]}, "sbatch_options="),
        ({"sbatch_options": "--exclusive '--comment=a\nb'"}, "sbatch_options="),
        ({"job_dir": "/tmp/a\nb"}, "job_dir="),
    ],
)
def test_a_control_character_in_an_option_is_refused_before_anything_is_written(
    kwargs: dict[str, Any], named: str, tmp_path: Path
) -> None:
    kwargs.setdefault("job_dir", str(tmp_path / "jobs"))
    with pytest.raises(ValueError, match="control character") as info:
        SlurmCluster(nodes=1, **kwargs)
    text = str(info.value)
    assert text.startswith(named) and "run the rest as shell on the node" in text, text
    assert not (tmp_path / "jobs").exists()


def test_from_sbatch_refuses_them_too() -> None:
    with pytest.raises(ValueError, match="partition=.*control character"):
        SlurmCluster.from_sbatch(["--nodes", "1", "--partition", SHELL])


@pytest.mark.parametrize(
    ("option", "written"),
    [
        ("--nodes=2", "--nodes=2"),
        ("--job-name=my job", '"--job-name=my job"'),
        ('--comment=say "hi"', '"--comment=say \\"hi\\""'),
        ("--comment=a\\b", '"--comment=a\\\\b"'),
        ("--comment=it's", '"--comment=it\'s"'),
    ],
)
def test_options_are_quoted_as_sbatch_reads_them(option: str, written: str) -> None:
    assert slurm.sbatch_quote(option) == written
    assert shlex.split(written) == [option]  # sbatch splits #SBATCH lines as a shell would


def test_the_batch_script_holds_each_option_on_one_line(tmp_path: Path) -> None:
    options = ["--job-name=my job", "--nodes=1", '--comment=x "y"']
    out = str(tmp_path / "dir with space" / "slurm-%j.out")
    script = slurm.batch_script(options, ["module load x"], ["python", "-m", "x"], out)
    lines = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert [shlex.split(line[len("#SBATCH ") :]) for line in lines] == [
        *([o] for o in options),
        [f"--output={out}"],
    ]
    with pytest.raises(ValueError, match="control character"):
        slurm.batch_script(["--comment=a\nb"], [], ["python"], out)
