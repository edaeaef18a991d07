"""The chest X-ray tasks on small folders in the published layouts: one task per finding over
one public pool, CheXpert's or MIMIC-CXR's observations as sources, and bad arguments refused."""

import numpy as np
import pytest

from dpmix_jax.data import cxr
from dpmix_jax.pipeline.chest_xray import nih_tasks
from tests import paper_fixtures as fixtures


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("chest_xray")
    fixtures.write_nih(root / "nih", patients=8, test_patients=2)
    fixtures.write_chexpert(root / "chexpert", patients=4)
    fixtures.write_mimic(root / "mimic", subjects=4)
    return root


@pytest.mark.parametrize("public", ["chexpert", "mimic"])
def test_one_task_per_finding_over_one_public_pool(roots, public):
    tasks = nih_tasks(
        roots / "nih", roots / public, public=public, image_size=8, findings=("Effusion", "Mass")
    )
    assert [t.name for t in tasks] == [f"NIH Effusion <- {public}", f"NIH Mass <- {public}"]
    assert [t.task_index for t in tasks] == [
        cxr.NIH_LABELS.index("Effusion"),
        cxr.NIH_LABELS.index("Mass"),
    ]
    first, second = tasks
    assert first.public is second.public and first.train is second.train
    assert first.k == 14 and first.source_names == tuple(first.public.label_names)
    assert first.image_shape[:2] == (8, 8) and first.true_weights is None
    assert len(first.test) == 4  # two patients of two images each
    labels = first.train.gather(np.arange(len(first.train)))["labels"]
    assert labels.shape == (len(first.train), len(cxr.NIH_LABELS))


def test_every_finding_by_default(roots):
    tasks = nih_tasks(roots / "nih", roots / "chexpert", public="chexpert", image_size=8)
    assert [t.task_index for t in tasks] == list(range(len(cxr.NIH_LABELS)))


@pytest.mark.parametrize(
    ("public", "findings", "message"),
    [
        ("padchest", None, "public must be one of"),
        ("chexpert", ("Effusion", "Fracture"), r"unknown NIH findings \['Fracture'\]"),
    ],
)
def test_bad_arguments_are_refused_before_reading(tmp_path, public, findings, message):
    with pytest.raises(ValueError, match=message):
        nih_tasks(tmp_path, tmp_path, public=public, image_size=8, findings=findings)
