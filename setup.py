"""Build hook: everything else is in pyproject.toml.

Installs ``src/ferrymq-spark-python.pth`` at the top of site-packages (Python runs ``.pth``
lines that start with ``import`` when the interpreter starts). It sets ``PYSPARK_PYTHON`` to the
interpreter itself when the variable is unset, so that Spark's Python workers, which otherwise
run ``python3`` from PATH, find FerryMQ's data source when a job runs as ``.venv/bin/python
job.py`` without an activated virtual environment (docs/spark.md, "Which Python the workers
run"). Editable installs (``pip install -e``) do not take files outside packages; the
Makefile copies the same file into the development venv.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SPARK_PYTHON_PTH = "ferrymq-spark-python.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also puts the ``.pth`` file beside the packages."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / "src" / SPARK_PYTHON_PTH),
                       str(Path(self.build_lib) / SPARK_PYTHON_PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / SPARK_PYTHON_PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
