"""``search.json``: a k search's suggested points, in the order they were suggested (:mod:`qed_ray.spec.search`;
the driver is :mod:`qed_ray.service.search`). A point is finished when its trials are; the file only grows."""

from __future__ import annotations

from qed_ray.records.codec import Record, RecordError, read_record, write_record
from qed_ray.records.layout import SweepDir
from qed_ray.spec.search import SearchPoint, studies


class SearchRecord(Record):
    """The points suggested so far, in order."""

    points: list[SearchPoint] = []


def read_search(layout: SweepDir, spec) -> SearchRecord:
    """``search.json`` (none yet: no points); raises RecordError naming the file for a damaged one, or for one
    whose points name an (entry, task) that ``spec`` (a SweepSpec with a ``search:`` block) does not search."""
    path = layout.search_file
    if not path.exists():
        return SearchRecord()
    record = read_record(path, SearchRecord)
    known = set(studies(spec))
    bad = [p for p in record.points if p.study not in known]
    if bad:
        raise RecordError(f"{path}: point {bad[0].model_dump()} names agent entry {bad[0].entry} on "
                          f"{bad[0].task}, which this spec does not search (restore the spec's agents)")
    return record


def write_search(layout: SweepDir, record: SearchRecord) -> None:
    """Writes ``search.json`` atomically."""
    write_record(layout.search_file, record)
