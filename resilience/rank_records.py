"""Each rank's record of how its run ended, in output_dir/rank_records/rankNNNNN.json: written once the job holds
output_dir's lease (host, pid, start time) and again as the rank ends (exit code, cause, where it was: step, pipeline
instruction, the peer it waited for). After a failed attempt the supervisor (resilience/supervisor.py) reads the
records that attempt wrote to name the rank that failed first: a rank killed without a word (SIGKILL, the OOM
killer, a lost node, a stopped process) keeps its start-up record only, which names it too. Nothing removes them:
each attempt's ranks overwrite their own, and the supervisor reads those started after it launched the attempt."""
import json
import os
import socket
import threading
import time

from checkpoints.files import write_text_atomic
from cluster.console import say

RECORDS_DIR = "rank_records"
_current = None  # this process's record, once start_record has run


class RankRecord:
    def __init__(self, output_dir, rank):
        self.path = os.path.join(output_dir, RECORDS_DIR, f"rank{rank:05d}.json")
        self.fields = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self.where = lambda: {}  # the hang watchdog's {where, waiting_for} of this rank, once it watches
        # held until the first end is on disk: a second end (the SIGTERM thread's, before its os._exit) must not
        # return while the first (the main thread's crash) is still being written; reentrant, so that a signal
        # handler's end in the writing thread returns at once rather than deadlocks
        self._ending = threading.RLock()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._write()

    def end(self, exit_code, cause, in_communication=False, follows_another=False):
        """The first end recorded is the one kept: a rank ends once. in_communication: the error came out of a
        collective or point-to-point call (most often a peer that failed first). follows_another: this rank ended
        because another one did (its launcher ended it), so it is not the first failure. A disk too full for the
        record leaves the start-up one: the exit code still says why, and the error already said it in one line."""
        with self._ending:
            if "ended" in self.fields:
                return
            self.fields.update(ended=time.time(), exit_code=exit_code, cause=cause, in_communication=in_communication,
                               follows_another=follows_another, **self.where())
            try:
                self._write()
            except OSError as error:
                say(f"rank {self.fields['rank']}: its end record was not written ({error.strerror}): "
                    f"{self.path}")

    def _write(self):
        write_text_atomic(self.path, json.dumps(self.fields))


def start_record(output_dir, rank):
    global _current
    _current = RankRecord(output_dir, rank)
    return _current


def record_end(exit_code, cause, in_communication=False, follows_another=False):
    """Record how this rank ends (nothing before start_record: a config error, which its exit code names)."""
    if _current is not None:
        _current.end(exit_code, cause, in_communication, follows_another)


def read_records(output_dir, since):
    """Every rank's record started at or after `since` (time.time(): the hosts' clocks agree far closer than a
    start-up takes), by rank."""
    directory = os.path.join(output_dir, RECORDS_DIR)
    if not os.path.isdir(directory):
        return []
    records = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                records.append(json.load(f))
    return [record for record in records if record["started"] >= since]
