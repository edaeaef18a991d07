"""Small stand-ins for the paper's data sets, written in their published layouts.

Each writer lays out files the way the real download does (file names, folder nesting, CSV
columns in their published order, compression), with a handful of synthetic examples, so that
the paper presets' loaders run on them unchanged:

    write_nih(root)               NIH ChestX-ray14: Data_Entry_2017.csv (12 fields with the
                                  trailing empty one), train_val_list.txt, test_list.txt,
                                  images_001/images/*.png (8-bit grayscale, one RGBA)
    write_chexpert(root)          CheXpert-v1.0-small: train.csv / valid.csv whose Path column
                                  starts with "CheXpert-v1.0-small/", train/patientN/studyM/*.jpg
    write_mimic(root)             MIMIC-CXR-JPG 2.0.0: mimic-cxr-2.0.0-{chexpert,metadata,split}
                                  .csv.gz and files/pXX/pSUBJECT/sSTUDY/DICOM.jpg
    write_enron(root)             the CMU maildir: maildir/<user>/sent_items/<n>. (RFC 822)
    write_common_pile(root)       one folder per Common Pile source: dolma-style .jsonl.gz
                                  records (and one plain .jsonl, one .parquet)
    write_openwebmath(root)       open-web-math parquet shards (url, text, date, metadata)
    write_gpt2_weights(folder, config)   a transformers GPT-2 folder (config.json and
                                  model.safetensors) with random weights of that shape

NIH labels follow a fixed pattern: each patient has one "No Finding" image and one with
Atelectasis, Effusion and a finding that cycles through the 14, so Atelectasis and Effusion have
both classes in every patient-disjoint part.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import pathlib

import numpy as np
from PIL import Image

from dpmix_jax.data.cxr import CHEXPERT_LABELS, NIH_LABELS

NIH_HEADER = (
    "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,"
    "View Position,OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y],"
)
# CheXpert's train.csv / valid.csv columns, in the published order.
CHEXPERT_COLUMNS = ("Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", *CHEXPERT_LABELS)
# mimic-cxr-2.0.0-chexpert.csv orders the 14 observations alphabetically.
MIMIC_LABEL_COLUMNS = ("subject_id", "study_id", *sorted(CHEXPERT_LABELS))
MIMIC_METADATA_COLUMNS = (
    "dicom_id",
    "subject_id",
    "study_id",
    "PerformedProcedureStepDescription",
    "ViewPosition",
    "Rows",
    "Columns",
    "StudyDate",
    "StudyTime",
    "ProcedureCodeSequence_CodeMeaning",
    "ViewCodeSequence_CodeMeaning",
    "PatientOrientationCodeSequence_CodeMeaning",
)
COMMON_PILE_SOURCES = (
    "arxiv_abstracts",
    "biodiversity_heritage_library",
    "caselaw_access_project",
    "doab",
    "foodista",
    "github_archive",
    "libretexts",
    "news",
    "peS2o",
    "pre_1929_books",
    "project_gutenberg",
    "pubmed",
    "python_enhancement_proposals",
    "stackexchange",
    "uk_hansard",
    "wikimedia",
)


def _image(rng: np.random.Generator, shape: tuple[int, int], label: float) -> np.ndarray:
    """An 8-bit chest-X-ray-like picture whose brightness depends a little on the label."""
    base = rng.integers(0, 160, size=shape)
    base[shape[0] // 4 : shape[0] // 2] += int(60 * label)
    return np.clip(base, 0, 255).astype(np.uint8)


def _csv_text(columns, rows) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)
    return out.getvalue()


def write_nih(root: pathlib.Path, *, patients: int = 32, test_patients: int = 4) -> pathlib.Path:
    """NIH ChestX-ray14 with two images per patient; the last `test_patients` are the test list."""
    rng = np.random.default_rng(0)
    images = root / "images_001" / "images"
    images.mkdir(parents=True)
    lines, train_val, test = [NIH_HEADER], [], []
    for patient in range(1, patients + 1):
        positive = {"Atelectasis", "Effusion", NIH_LABELS[patient % len(NIH_LABELS)]}
        findings = "|".join(name for name in NIH_LABELS if name in positive)
        for follow_up, labels in enumerate((findings, "No Finding")):
            name = f"{patient:08d}_{follow_up:03d}.png"
            pixels = _image(rng, (48, 48), float(follow_up == 0))
            picture = Image.fromarray(pixels, mode="L")
            if patient == 1 and follow_up == 0:  # the real set holds a few RGBA PNGs
                picture = picture.convert("RGBA")
            picture.save(images / name)
            age = f"{30 + patient:03d}Y"
            lines.append(
                f"{name},{labels},{follow_up},{patient},{age},{'MF'[patient % 2]},PA,"
                "2500,2048,0.143,0.143,"
            )
            (test if patient > patients - test_patients else train_val).append(name)
    (root / "Data_Entry_2017.csv").write_text("\n".join(lines) + "\n")
    (root / "train_val_list.txt").write_text("\n".join(train_val) + "\n")
    (root / "test_list.txt").write_text("\n".join(test) + "\n")
    return root


def _observation(rng: np.random.Generator) -> str:
    return str(rng.choice(["1.0", "0.0", "-1.0", ""], p=[0.3, 0.3, 0.1, 0.3]))


def write_chexpert(root: pathlib.Path, *, patients: int = 12) -> pathlib.Path:
    """CheXpert-v1.0-small under `root` (any folder name): one study per patient with a frontal
    and a lateral view; the CSV paths start with the data set's own folder name."""
    rng = np.random.default_rng(1)
    for split, count in (("train", patients), ("valid", 2)):
        rows = []
        for patient in range(1, count + 1):
            study = root / split / f"patient{patient:05d}" / "study1"
            study.mkdir(parents=True)
            for view, (kind, position) in enumerate((("Frontal", "AP"), ("Lateral", ""))):
                name = f"view{view + 1}_{kind.lower()}.jpg"
                labels = [_observation(rng) for _ in CHEXPERT_LABELS]
                Image.fromarray(_image(rng, (40, 32), float(labels[2] == "1.0"))).save(study / name)
                path = f"CheXpert-v1.0-small/{split}/patient{patient:05d}/study1/{name}"
                rows.append([path, "Female", 60 + patient, kind, position, *labels])
        (root / f"{split}.csv").write_text(_csv_text(CHEXPERT_COLUMNS, rows))
    return root


def _write_csv_gz(path: pathlib.Path, columns, rows) -> None:
    path.write_bytes(gzip.compress(_csv_text(columns, rows).encode()))


def write_mimic(root: pathlib.Path, *, subjects: int = 12) -> pathlib.Path:
    """MIMIC-CXR-JPG 2.0.0: one study per subject with a PA, a LATERAL and an unlabelled-view
    image; gzip-compressed CSVs as published."""
    rng = np.random.default_rng(2)
    labels, metadata, splits = [], [], []
    for index in range(subjects):
        subject, study = str(10_000_032 + index * 7919), str(50_000_000 + index)
        labels.append([subject, study, *(_observation(rng) for _ in CHEXPERT_LABELS)])
        folder = root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}"
        folder.mkdir(parents=True)
        for view, position in enumerate(("PA", "LATERAL", "")):
            dicom = f"{index:08x}-{view:08x}-5d4e1f2a-3b6c7d8e-9f0a1b2c"
            Image.fromarray(_image(rng, (44, 36), float(view == 0))).save(folder / f"{dicom}.jpg")
            metadata.append(
                [dicom, subject, study, "CHEST (PA AND LAT)", position, 3056, 2544, 21800506,
                 213014.531, "CHEST (PA AND LAT)", "postero-anterior", "Erect"]
            )  # fmt: skip
            splits.append([dicom, study, subject, "validate" if index == 0 else "train"])
    _write_csv_gz(root / "mimic-cxr-2.0.0-chexpert.csv.gz", MIMIC_LABEL_COLUMNS, labels)
    _write_csv_gz(root / "mimic-cxr-2.0.0-metadata.csv.gz", MIMIC_METADATA_COLUMNS, metadata)
    _write_csv_gz(
        root / "mimic-cxr-2.0.0-split.csv.gz",
        ("dicom_id", "study_id", "subject_id", "split"),
        splits,
    )
    return root


_TOPICS = (
    "gas pipeline capacity contract trading desk schedule",
    "power prices california demand curtailment forecast",
    "legal review of the counterparty agreement and credit terms",
    "meeting tomorrow lunch agenda budget approval",
)


def _sentence(rng: np.random.Generator, words: str, length: int) -> str:
    vocabulary = words.split()
    return " ".join(rng.choice(vocabulary, size=length)).capitalize() + "."


def write_enron(root: pathlib.Path, *, users: int = 20, messages: int = 2) -> pathlib.Path:
    """The CMU Enron maildir under `root/maildir`: per user `sent_items/1.` ... (one user's mail
    in `_sent_mail`, one user with no sent folder at all), messages with the dataset's headers,
    quoted replies and forwarded parts."""
    rng = np.random.default_rng(3)
    maildir = root / "maildir"
    for index in range(users):
        user = f"user-{chr(97 + index % 26)}{index}"
        folder = maildir / user / ("_sent_mail" if index == 1 else "sent_items")
        folder.mkdir(parents=True)
        topic = _TOPICS[index % len(_TOPICS)]
        for number in range(1, messages + 1):
            body = " ".join(_sentence(rng, topic, 8) for _ in range(3))
            if number == 1:
                body += "\n\n-----Original Message-----\nFrom: someone\n> quoted text here"
            if number == 2:
                body += "\n---------------------- Forwarded by x/HOU/ECT on 01/02/2001 ---"
            message = (
                f"Message-ID: <{index}{number}.JavaMail.evans@thyme>\n"
                "Date: Mon, 14 May 2001 16:39:00 -0700 (PDT)\n"
                f"From: {user}@enron.com\nTo: team@enron.com\nSubject: Re: update {number}\n"
                "Mime-Version: 1.0\nContent-Type: text/plain; charset=us-ascii\n"
                "Content-Transfer-Encoding: 7bit\nX-From: Someone\nX-To: Team\nX-cc: \n"
                f"X-bcc: \nX-Folder: \\{user}\\Sent Items\nX-Origin: {user}\n"
                f"X-FileName: {user}.pst\n\n{body}\n"
            )
            (folder / f"{number}.").write_text(message)
    (maildir / "user-without-sent" / "inbox").mkdir(parents=True)
    (maildir / "user-without-sent" / "inbox" / "1.").write_text("Subject: hi\n\nhello\n")
    return root


def _domain_texts(rng: np.random.Generator, index: int, count: int) -> list[str]:
    vocabulary = " ".join(f"w{index}x{j}" for j in range(12)) + " the of and data model"
    return [" ".join(_sentence(rng, vocabulary, 10) for _ in range(4)) for _ in range(count)]


def _write_parquet(path: pathlib.Path, columns: dict[str, list]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def write_common_pile(
    root: pathlib.Path, *, sources: tuple[str, ...] = COMMON_PILE_SOURCES, documents: int = 6
) -> pathlib.Path:
    """One folder per Common Pile source holding dolma-style records (`id`, `text`, `source`,
    `added`, `metadata`): `.jsonl.gz` shards, one source as plain `.jsonl`, one as `.parquet`."""
    rng = np.random.default_rng(4)
    for index, source in enumerate(sources):
        folder = root / source
        folder.mkdir(parents=True)
        texts = _domain_texts(rng, index, documents)
        if index == 1:
            _write_parquet(folder / "train-00000-of-00001.parquet", {"id": [str(i) for i in
                           range(documents)], "text": texts})  # fmt: skip
            continue
        records = "".join(
            json.dumps(
                {"id": f"{source}-{i}", "text": t, "source": source, "added": "2025-01-01",
                 "metadata": {"license": "CC-BY-4.0"}}
            ) + "\n"
            for i, t in enumerate(texts)
        )  # fmt: skip
        if index == 2:
            (folder / "0000.jsonl").write_text(records)
        else:
            (folder / f"0000_{source}.jsonl.gz").write_bytes(gzip.compress(records.encode()))
    return root


def write_openwebmath(root: pathlib.Path, *, documents: int = 60, shards: int = 2) -> pathlib.Path:
    """open-web-math's parquet shards under `root/data/` (columns url, text, date, metadata)."""
    rng = np.random.default_rng(5)
    data = root / "data"
    data.mkdir(parents=True)
    vocabulary = "let x be a real number then the integral of f over the interval equals zero"
    texts = [" ".join(_sentence(rng, vocabulary, 12) for _ in range(3)) for _ in range(documents)]
    per_shard = -(-documents // shards)
    for shard in range(shards):
        part = texts[shard * per_shard : (shard + 1) * per_shard]
        _write_parquet(
            data / f"train-{shard:05d}-of-{shards:05d}.parquet",
            {
                "url": [f"https://math.example.org/{shard}/{i}" for i in range(len(part))],
                "text": part,
                "date": ["2023-09-06T00:00:00"] * len(part),
                "metadata": ['{"extraction_info": {}}'] * len(part),
            },
        )
    return root


def write_gpt2_weights(folder: pathlib.Path, config) -> pathlib.Path:
    """A transformers `save_pretrained` GPT-2 folder (`config.json`, `model.safetensors` with
    `transformer.`-prefixed names; the head is tied, so not stored) with random weights of
    `config`'s shape."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(6)
    d, inner = config.n_embd, config.mlp_dim

    def normal(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {
        "wte.weight": normal(config.vocab_size, d),
        "wpe.weight": normal(config.n_positions, d),
    }
    for layer in range(config.n_layer):
        p = f"h.{layer}."
        for norm in ("ln_1", "ln_2"):
            tensors[p + norm + ".weight"] = np.ones(d, np.float32)
            tensors[p + norm + ".bias"] = np.zeros(d, np.float32)
        for name, shape in (
            ("attn.c_attn", (d, 3 * d)),
            ("attn.c_proj", (d, d)),
            ("mlp.c_fc", (d, inner)),
            ("mlp.c_proj", (inner, d)),
        ):
            tensors[p + name + ".weight"] = normal(*shape)
            tensors[p + name + ".bias"] = np.zeros(shape[1], np.float32)
    tensors["ln_f.weight"] = np.ones(d, np.float32)
    tensors["ln_f.bias"] = np.zeros(d, np.float32)
    tensors = {f"transformer.{k}": v for k, v in tensors.items()}
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "n_embd": d,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "layer_norm_epsilon": 1e-5,
    }
    (folder / "config.json").write_text(json.dumps(hf_config, indent=1))
    return folder
