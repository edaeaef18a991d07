"""Tests for the chest X-ray loaders on tiny generated fixtures in the real folder layouts."""

import csv

import numpy as np
import pytest
from PIL import Image

from dpmix_jax.data import cxr
from dpmix_jax.privacy import assign_parts


def _image(path, value, size=(12, 10), fmt=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full(size[::-1], value, dtype=np.uint8)).save(path, format=fmt)


def _write_csv(path, header, rows):
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


NIH_HEADER = [
    "Image Index", "Finding Labels", "Follow-up #", "Patient ID", "Patient Age",
    "Patient Gender", "View Position", "OriginalImage[Width", "Height]",
]  # fmt: skip
NIH_ROWS = [
    ("00000001_000.png", "Cardiomegaly", 1),
    ("00000001_001.png", "Cardiomegaly|Emphysema", 1),
    ("00000002_000.png", "No Finding", 2),
    ("00000003_000.png", "Hernia|Infiltration|Pleural_Thickening", 3),
    ("00000004_000.png", "Effusion", 4),
    ("00000005_000.png", "No Finding", 5),
    ("00000005_001.png", "Mass|Nodule", 5),
    ("00000006_000.png", "Atelectasis", 6),
]


@pytest.fixture
def nih_root(tmp_path):
    rows = []
    for n, (name, findings, patient) in enumerate(NIH_ROWS):
        folder = "images_001/images" if n < 4 else "images_002/images"
        _image(tmp_path / folder / name, 20 * n)
        rows.append([name, findings, 0, patient, 50, "M", "PA", 12, 10])
    _write_csv(tmp_path / "Data_Entry_2017.csv", NIH_HEADER, rows)
    (tmp_path / "test_list.txt").write_text("00000004_000.png\n00000006_000.png\n")
    train_val = [r[0] for r in NIH_ROWS if r[0] not in ("00000004_000.png", "00000006_000.png")]
    (tmp_path / "train_val_list.txt").write_text("\n".join(train_val) + "\n")
    return tmp_path


def test_nih_labels_and_images(nih_root):
    ds = cxr.load_nih(nih_root, image_size=(8, 6))
    assert len(ds) == 8 and ds.label_names == cxr.NIH_LABELS and len(cxr.NIH_LABELS) == 14
    for row, (_, findings, patient) in enumerate(NIH_ROWS):
        expected = [name in findings.split("|") for name in cxr.NIH_LABELS]
        np.testing.assert_array_equal(ds.labels[row], expected)
        assert ds.patient_ids[row] == patient
    assert ds.labels[2].sum() == 0 and ds.labels[3].sum() == 3
    example = ds[5]
    assert example["image"].shape == (8, 6, 1) and example["image"].dtype == np.float32
    np.testing.assert_allclose(example["image"], 100 / 255, atol=1e-6)
    batch = ds.gather(np.array([0, -1, 7]))
    np.testing.assert_allclose(batch["image"][2], 140 / 255, atol=1e-6)
    assert not batch["image"][1].any() and not batch["labels"][1].any()


def test_an_image_over_the_decompression_bomb_limit_is_refused_when_loaded(nih_root, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # the fixture's images have 120 pixels
    with pytest.raises(ValueError, match=r"image .*00000001_000.png: 12x10 pixels is over"):
        cxr.load_nih(nih_root)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)  # over twice the limit: Pillow refuses
    with pytest.raises(ValueError, match=r"image .*00000001_000.png: its size is over"):
        cxr.load_nih(nih_root)


def test_nih_official_and_patient_disjoint_splits(nih_root):
    splits = cxr.nih_official_splits(nih_root, val_fraction=0.4, seed=0, image_size=(4, 4))
    assert len(splits["test"]) == 2 and len(splits["train"]) + len(splits["val"]) == 6
    assert set(splits["test"].patient_ids.tolist()) == {4, 6}
    assert not set(splits["train"].patient_ids.tolist()) & set(splits["val"].patient_ids.tolist())
    train_val_patients = np.array([1, 2, 3, 5])
    in_val = assign_parts(train_val_patients, (0.6, 0.4), key=0) == 1
    assert set(splits["val"].patient_ids.tolist()) == set(train_val_patients[in_val].tolist())


def test_nih_refuses_an_image_under_two_patients(nih_root):
    csv_path = nih_root / "Data_Entry_2017.csv"
    with csv_path.open("a", newline="") as f:
        csv.writer(f).writerow(["00000002_000.png", "No Finding", 0, 7, 50, "M", "PA", 12, 10])
    message = r"Data_Entry_2017.csv rows 4 and 10: image '00000002_000.png' is listed twice"
    with pytest.raises(ValueError, match=message + r" \(Patient ID '2' and '7'\)"):
        cxr.load_nih(nih_root)
    with pytest.raises(ValueError, match=message):
        cxr.nih_official_splits(nih_root)


@pytest.mark.parametrize("overlap", ["equal", "one image"])
def test_nih_refuses_a_test_list_overlapping_train_val(nih_root, overlap):
    train_val = (nih_root / "train_val_list.txt").read_text()
    if overlap == "equal":
        (nih_root / "test_list.txt").write_text(train_val)
    else:
        (nih_root / "test_list.txt").write_text("00000004_000.png\n00000003_000.png\n")
    message = r"train_val_list.txt and .*test_list.txt both list image '0000000[13]_000.png'"
    for subset in ("train_val", "test"):
        with pytest.raises(ValueError, match=message):
            cxr.load_nih(nih_root, subset=subset)
    with pytest.raises(ValueError, match=message):
        cxr.nih_official_splits(nih_root)


def test_adding_a_patient_moves_no_other_patient():
    def dataset(patients):
        n = len(patients)
        return cxr.CxrDataset(
            paths=[f"{i}.png" for i in range(n)],
            labels=np.zeros((n, 14)),
            label_names=cxr.NIH_LABELS,
            patient_ids=np.asarray(patients),
            views=["frontal"] * n,
            image_size=(4, 4),
        )

    patients = np.repeat(np.arange(1, 1001), 2)  # two images each
    before = cxr.patient_disjoint_split(dataset(patients), (0.8, 0.1, 0.1), seed=0)
    part_of = {int(patients[i]): j for j, idx in enumerate(before) for i in idx}
    grown = np.concatenate([[5000], patients])  # a new patient as the first row
    after = cxr.patient_disjoint_split(dataset(grown), (0.8, 0.1, 0.1), seed=0)
    moved = {
        p for j, idx in enumerate(after) for p in grown[idx].tolist() if part_of.get(p, j) != j
    }
    assert not moved
    assert all(0.05 < len(idx) / len(patients) < 0.85 for idx in before)


def test_nih_malformed_inputs(nih_root):
    text = (nih_root / "Data_Entry_2017.csv").read_text()
    (nih_root / "Data_Entry_2017.csv").write_text(text.replace("Emphysema", "Emphysem"))
    with pytest.raises(ValueError, match=r"Data_Entry_2017.csv row 3: unknown finding 'Emphysem'"):
        cxr.load_nih(nih_root)
    (nih_root / "Data_Entry_2017.csv").write_text(text.replace("Patient ID", "Patient"))
    with pytest.raises(ValueError, match=r"Data_Entry_2017.csv lacks column\(s\) \['Patient ID'\]"):
        cxr.load_nih(nih_root)
    (nih_root / "Data_Entry_2017.csv").write_text(text)
    (nih_root / "images_002/images/00000005_001.png").unlink()
    with pytest.raises(ValueError, match="00000005_001.png, which does not exist"):
        cxr.load_nih(nih_root)
    ds = cxr.load_nih(nih_root, on_missing="skip")
    assert len(ds) == 7 and ds.skipped == {"missing_image": 1}
    (nih_root / "images_001/images/00000002_000.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="cannot read image .*00000002_000.png"):
        cxr.load_nih(nih_root, on_missing="skip")
    with pytest.raises(ValueError, match="missing file"):
        cxr.load_nih(nih_root / "nowhere")


CHEXPERT_HEADER = ["Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", *cxr.CHEXPERT_LABELS]


@pytest.fixture
def chexpert_root(tmp_path):
    root = tmp_path / "CheXpert-v1.0-small"
    entries = [
        ("train/patient00001/study1/view1_frontal.jpg", "Frontal", ["1.0", "", "-1.0", "0.0"]),
        ("train/patient00001/study1/view2_lateral.jpg", "Lateral", ["", "1.0", "", ""]),
        ("train/patient00002/study1/view1_frontal.jpg", "Frontal", ["0.0", "-1.0", "1.0", "1.0"]),
        ("train/patient00003/study2/view1_frontal.jpg", "Frontal", ["", "", "", ""]),
    ]
    rows = []
    for n, (rel, view, first_values) in enumerate(entries):
        _image(root / rel, 30 * n, fmt="JPEG")
        values = first_values + ["1.0" if j % 5 == n else "" for j in range(10)]
        rows.append([f"CheXpert-v1.0-small/{rel}", "Female", 60, view, "AP", *values])
    _write_csv(root / "train.csv", CHEXPERT_HEADER, rows)
    return root, rows


def test_chexpert_labels_views_patients(chexpert_root):
    root, rows = chexpert_root
    ds = cxr.load_chexpert(root, views="all", image_size=(5, 5))
    assert len(ds) == 4 and ds.label_names == cxr.CHEXPERT_LABELS
    for r, row in enumerate(rows):
        np.testing.assert_array_equal(ds.labels[r], [v == "1.0" for v in row[5:]])
    np.testing.assert_array_equal(ds.patient_ids, [1, 1, 2, 3])
    assert ds.views == ("frontal", "lateral", "frontal", "frontal")
    frontal = cxr.load_chexpert(root, image_size=(5, 5))
    assert len(frontal) == 3 and "lateral" not in frontal.views
    np.testing.assert_allclose(frontal[1]["image"], 60 / 255, atol=3 / 255)  # JPEG rounding
    assert len(cxr.load_chexpert(root, views="lateral")) == 1
    parts = cxr.patient_disjoint_split(ds, (0.5, 0.5), seed=0)
    assert not set(ds.patient_ids[parts[0]]) & set(ds.patient_ids[parts[1]])


def test_chexpert_rejects_unknown_values(chexpert_root):
    root, rows = chexpert_root
    rows[2][7] = "2.0"  # Cardiomegaly, the third observation
    _write_csv(root / "train.csv", CHEXPERT_HEADER, rows)
    with pytest.raises(ValueError, match=r"train.csv row 4: column 'Cardiomegaly' has value '2.0'"):
        cxr.load_chexpert(root)
    with pytest.raises(ValueError, match="missing file .*valid.csv"):
        cxr.load_chexpert(root, split="valid")


def test_mimic_cxr_join_views_and_split(tmp_path):
    label_rows, meta_rows, split_rows = [], [], []
    studies = [("10000032", "50414267", "1.0"), ("10000032", "53189527", "-1.0"),
               ("10000764", "57375967", "")]  # fmt: skip
    for s, (subject, study, cardio) in enumerate(studies):
        values = ["" for _ in cxr.CHEXPERT_LABELS]
        values[2] = cardio
        values[13] = "1.0" if s == 2 else "0.0"
        label_rows.append([subject, study, *values])
        for v, position in enumerate(("PA", "LATERAL")):
            dicom = f"d{s}{v}"
            meta_rows.append([dicom, subject, study, position])
            split_rows.append([dicom, study, subject, "test" if s == 2 else "train"])
            path = (
                tmp_path
                / "files"
                / f"p{subject[:2]}"
                / f"p{subject}"
                / f"s{study}"
                / f"{dicom}.jpg"
            )
            _image(path, 100, fmt="JPEG")
    meta_rows.append(["d99", "10000764", "59999999", "AP"])  # a study without labels
    meta_rows.append(["d98", "10000764", "57375967", ""])  # no view position
    _write_csv(
        tmp_path / "mimic-cxr-2.0.0-chexpert.csv",
        ["subject_id", "study_id", *cxr.CHEXPERT_LABELS],
        label_rows,
    )
    _write_csv(
        tmp_path / "mimic-cxr-2.0.0-metadata.csv",
        ["dicom_id", "subject_id", "study_id", "ViewPosition"],
        meta_rows,
    )
    _write_csv(
        tmp_path / "mimic-cxr-2.0.0-split.csv",
        ["dicom_id", "study_id", "subject_id", "split"],
        split_rows,
    )
    ds = cxr.load_mimic_cxr(tmp_path, image_size=(4, 4))
    assert len(ds) == 3 and ds.skipped == {"unlabelled_study": 1, "other_view": 1}
    np.testing.assert_array_equal(ds.labels[:, 2], [1, 0, 0])
    np.testing.assert_array_equal(ds.labels[:, 13], [0, 0, 1])
    np.testing.assert_array_equal(ds.patient_ids, [10000032, 10000032, 10000764])
    assert ds.paths[2].name == "d20.jpg" and ds[0]["image"].shape == (4, 4, 1)
    assert len(cxr.load_mimic_cxr(tmp_path, views="all")) == 6
    test = cxr.load_mimic_cxr(tmp_path, split="test", views="all")
    assert len(test) == 2 and set(test.patient_ids.tolist()) == {10000764}
    (tmp_path / "mimic-cxr-2.0.0-split.csv").unlink()
    with pytest.raises(ValueError, match="missing file .*split.csv"):
        cxr.load_mimic_cxr(tmp_path, split="test")
