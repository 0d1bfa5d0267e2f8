"""Save on preemption, every host at the same step, and resume from it.

A scheduler preempts a job with SIGTERM (Slurm, Kubernetes; `python -m
tfpar.launch` forwards its own SIGTERM/SIGINT to every host). Under
`PreemptionCheckpoint`, a host that receives one does not stop: it tells
the other hosts (tfpar's heartbeat channel, `tfpar.host_watch`), and the
hosts agree on the step to save at:

- at the end of a step c, a host that knows of the preemption and of no
  agreed step proposes step t = c + 2 and sends it to every host, waiting
  for each to take it;
- every host saves (`tfpar.save_checkpoint(model, directory, step=t)`) at
  the end of step t and stops training.

Why every host saves at the same t: the hosts run every step's
collectives together, so no host can finish step c + 1 before the
proposer (done with c, sending) has begun it, i.e. before each host has
the proposal. A host that would propose later (at the end of a step
c' > c) already knows t and does not; two proposals made without knowing
of each other are therefore made at the same c, and agree. On one host
the save happens at the end of the step that is running.

A signal within the last two steps of `fit` (or outside `fit`) saves
nothing here: no step is left to agree on without a collective, and the
script's own end-of-training save applies (`callback.requested` says a
signal came). The next start restores the latest checkpoint of `directory` (if any) at
the beginning of training: `restored_step` says which step (the data
position is the script's: e.g. `fit(initial_epoch=step // steps_per_epoch)`).

Example:

>>> callback = tfpar.PreemptionCheckpoint("/tmp/run/preempt")
>>> model.fit(x, y, epochs=3, callbacks=[callback])    # doctest: +SKIP
>>> callback.preempted, callback.saved_step            # doctest: +SKIP
(True, 14)
"""

import signal
import sys
import threading

import keras

from tfpar import host_watch
from tfpar.checkpoint import latest_checkpoint, restore_checkpoint
from tfpar.checkpoint import save_checkpoint

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_MARGIN = 2  # steps between the proposal and the save (see above)


class PreemptionCheckpoint(keras.callbacks.Callback):
    """On SIGTERM/SIGINT: all hosts save at one agreed step, then stop.

    Args:
        directory: the checkpoint directory every host sees (as for
            `tfpar.save_checkpoint`).
        resume: restore the latest checkpoint of `directory`, if there is
            one, when training begins.
        signals: the signals that mean preemption.
    """

    def __init__(self, directory, resume=True, signals=SIGNALS):
        super().__init__()
        if not isinstance(directory, str) or not directory:
            raise ValueError(
                "PreemptionCheckpoint(directory) needs a directory path. "
                f"Received: directory={directory!r}")
        self.directory = directory
        self.resume = resume
        self.signals = tuple(signals)
        self.preempted = False
        self.saved_step = None
        self.restored_step = None
        self._requested = threading.Event()
        self._target = None
        self._completed = 0
        self._previous = {}

    @property
    def requested(self):
        """Whether a preemption signal (or a peer's notice) came."""
        return self._requested.is_set()

    # -- Keras callbacks ------------------------------------------------------

    def on_train_begin(self, logs=None):
        if self.resume and latest_checkpoint(self.directory) is not None:
            self.restored_step = restore_checkpoint(self.model,
                                                    self.directory)
            self._completed = self.restored_step
        self._previous = {number: signal.signal(number, self._signalled)
                          for number in self.signals}
        watch = host_watch.current()
        if watch is not None:
            watch.on_preempt = self._heard

    def on_train_batch_end(self, batch, logs=None):
        self._completed += 1
        target = self._agreed_step()
        if target is None or self._completed < target:
            return
        save_checkpoint(self.model, self.directory, step=self._completed)
        self.saved_step = self._completed
        self.preempted = True
        self.model.stop_training = True
        sys.stderr.write(f"tfpar: preempted; saved step {self._completed} "
                         f"to {self.directory}\n")

    def on_train_end(self, logs=None):
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}
        watch = host_watch.current()
        if watch is not None and watch.on_preempt == self._heard:
            watch.on_preempt = None

    # -- the agreement --------------------------------------------------------

    def _agreed_step(self):
        """The step to save at (None: no preemption)."""
        if self._target is not None or not self._requested.is_set():
            return self._target
        watch = host_watch.current()
        if watch is None:
            self._target = self._completed  # one host: save now
            return self._target
        self._target = self._completed + _MARGIN
        watch.tell_others("preempt", self._target)
        return self._target

    def _signalled(self, number, _frame):
        if self._requested.is_set():
            return
        self._requested.set()
        watch = host_watch.current()
        if watch is not None:  # off the handler: sends may take a while
            threading.Thread(target=watch.tell_others, args=("preempt", 0),
                             daemon=True).start()

    def _heard(self, target):
        """Another host's preempt message: 0 = a notice, else its step."""
        self._requested.set()
        if target:
            self._target = max(self._target or 0, target)
