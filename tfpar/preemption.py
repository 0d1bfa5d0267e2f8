"""Save on preemption, every host at the same step, and resume from it.

A scheduler preempts a job with SIGTERM (Slurm, Kubernetes; `python -m
tfpar.launch` forwards its own SIGTERM/SIGINT to every host). Under
`PreemptionCheckpoint` (a Keras callback, for `fit`) or
`tfpar.on_preemption` (a context manager, for a custom `strategy.run`
loop), a host that receives one does not stop: it tells the other hosts
(tfpar's heartbeat channel, `tfpar.host_watch`), and the hosts agree on
the step to save at (`PreemptionAgreement`, which both drive):

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

"Finish" is the step's collectives completing, not its call returning:
TF runs a step asynchronously, and a loop that counted returned calls
could run steps ahead of another host's, propose its own t and save
at a step the others never reach (each host then waits for the others
in a collective). So on several hosts a step is counted once this host's
work has run: `fit` waits for each step's loss (`tfpar.watchdog`), a
custom loop's `guard.step_end()` waits for everything it dispatched.

A signal within the last two steps of training (or outside it) saves
nothing here: no step is left to agree on without a collective, and the
script's own end-of-training save applies (`.requested` says a signal
came). The next start restores the latest checkpoint of `directory` (if
any) when training begins: `restored_step` says which step (the data
position is the script's: e.g. `fit(initial_epoch=step //
steps_per_epoch)`, or a custom loop starting at `guard.start_step`).

Each run (each `fit` with the callback, each `with` of a guard) is one
agreement: it counts from the step it restored (0 when none was restored),
with no signal, agreed step or save yet, as a new callback or guard would;
reusing one for a second run is the same as making a new one. A signal
that came in a run and was not answered by a save is the script's to
handle after that run (`.requested`); the next run does not inherit it.

Example (fit):

>>> callback = tfpar.PreemptionCheckpoint("/tmp/run/preempt")
>>> model.fit(x, y, epochs=3, callbacks=[callback])    # doctest: +SKIP
>>> callback.preempted, callback.saved_step            # doctest: +SKIP
(True, 14)
"""

import functools
import signal
import sys
import threading
import weakref

import keras
from keras.src.backend.tensorflow import trainer as _tf_trainer

from tfpar import _compat
from tfpar import host_watch
from tfpar.checkpoint import latest_checkpoint, restore_checkpoint
from tfpar.checkpoint import save_checkpoint

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# PreemptionCheckpoints between on_train_begin and the end of their fit.
_RUNNING = weakref.WeakSet()


def _fit_ending_runs(original, hooks):
    """Keras' `fit`, which skips `on_train_end` when it raises (Keras 3):
    then every PreemptionCheckpoint running on this model ends its run
    (its signal handlers put back) before the error propagates."""

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            for callback in list(_RUNNING):
                if callback.model is self:
                    callback.on_train_end()
            raise

    return fit


# The preemption feature's patch (installed by the first
# PreemptionCheckpoint; `tfpar._compat.uninstall` undoes it).
PATCHES = (_compat.Patch(
    "preemption_fit", lambda: _tf_trainer.TensorFlowTrainer, "fit",
    _fit_ending_runs),)
_MARGIN = 2  # steps between the proposal and the save (see above)


class PreemptionAgreement:
    """The hosts' agreement on the step to save at (module docstring).

    Counts the steps the training loop reports (`step_end`), catches
    `signals` between `install` and `uninstall` and hears the other hosts'
    notices and proposals through `tfpar.host_watch`.
    """

    def __init__(self, signals=SIGNALS):
        self.signals = tuple(signals)
        self.completed = 0  # steps finished (from the restored step on)
        self._requested = threading.Event()
        self._target = None
        self._previous = {}
        self._installed = False

    def begin(self, completed):
        """Starts a run after `completed` steps (the restored step, or 0):
        no signal, agreed step or save of an earlier run is kept. Installs
        the handlers until `uninstall`."""
        if self._installed:  # a run that never ended (a `fit` that raised
            self.uninstall()  # skips on_train_end): the older handlers back
        self.completed = completed
        self._requested.clear()
        self._target = None
        self.install()

    @property
    def requested(self):
        """Whether a preemption signal (or a peer's notice) came."""
        return self._requested.is_set()

    def install(self):
        """This host's signal handlers and peer hook, until `uninstall`."""
        self._previous = {number: signal.signal(number, self._signalled)
                          for number in self.signals}
        self._installed = True
        watch = host_watch.current()
        if watch is not None:
            watch.on_preempt = self._heard

    def uninstall(self):
        """The signal handlers from before `install`, and no peer hook."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}
        self._installed = False
        watch = host_watch.current()
        if watch is not None and watch.on_preempt == self._heard:
            watch.on_preempt = None

    def step_end(self):
        """Counts a finished step; True when this is the step to save at.
        RuntimeError when this host has passed the agreed step already
        (the other hosts save there: a hang in their next collective)."""
        self.completed += 1
        target = self._agreed_step()
        if target is not None and self.completed > target:
            watch = host_watch.current()
            host = f"host {watch.host_id}" if watch else "this host"
            raise RuntimeError(
                f"tfpar preemption: {host} has finished step "
                f"{self.completed}, past the step {target} the hosts agreed "
                "to save at, so they cannot save at one step; it stops here "
                "instead of waiting for the others in a collective. Every "
                "host must report "
                "every finished step (guard.step_end() after each step, on "
                "every host); the last checkpoint in the directory is "
                "intact. Received: agreed step "
                f"{target}, steps finished {self.completed}")
        return target is not None and self.completed >= target

    def _agreed_step(self):
        """The step to save at (None: no preemption)."""
        if self._target is not None or not self._requested.is_set():
            return self._target
        watch = host_watch.current()
        if watch is None:
            self._target = self.completed  # one host: save now
            return self._target
        self._target = self.completed + _MARGIN
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


def _check_arguments(caller, directory, resume, signals):
    """`caller`'s (a name for the errors) directory, resume and signals
    checked: ValueError naming the argument, what came and what to pass.
    Returns the signals as `signal.Signals`."""
    if not isinstance(directory, str) or not directory:
        raise ValueError(
            f"{caller}(directory=...) needs a directory path (a non-empty "
            f"str, e.g. str(path)) that every host sees. Received: "
            f"directory={directory!r}")
    if not isinstance(resume, bool):
        raise ValueError(f"{caller}(resume=...) is True or False. "
                         f"Received: resume={resume!r}")
    return _signal_numbers(caller, signals)


def _check_model(caller, model):
    """ValueError unless `model` is a compiled Keras model: a save holds
    its weights and its optimizer's state."""
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"{caller}(model=...) needs the Keras model the loop trains "
            f"(a keras.Model). Received: model={model!r}")
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"{caller}(model=...) saves the model with its optimizer's "
            "state, and this model has no optimizer: compile it with the "
            "optimizer the loop applies (model.compile(optimizer=...)) "
            f"before entering. Received: model={model.name!r}")


def _signal_numbers(caller, signals):
    try:
        numbers = tuple(signal.Signals(number) for number in signals)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{caller}(signals=...) is a sequence of signal numbers "
            f"(e.g. (signal.SIGTERM,)). Received: signals={signals!r}"
        ) from error
    uncatchable = [number.name for number in numbers
                   if number in (signal.SIGKILL, signal.SIGSTOP)]
    if uncatchable:
        raise ValueError(
            f"{caller}(signals=...) cannot catch {', '.join(uncatchable)} "
            "(no process can): pass signals a handler can catch, e.g. "
            f"(signal.SIGTERM, signal.SIGINT). Received: signals={signals!r}")
    return numbers


def _start_run(run):
    """Starts a run of a `PreemptionCheckpoint` or `PreemptionGuard`: no
    save yet, the latest checkpoint of its directory restored (if
    `resume`), its agreement begun from the restored step (0 without)."""
    run.preempted, run.saved_step = False, None
    run.restored_step = (_resume(run.model, run.directory) if run.resume
                         else None)
    run._agreement.begin(run.restored_step or 0)  # noqa: SLF001


def _resume(model, directory):
    """The step restored from `directory`'s latest checkpoint, or None."""
    if latest_checkpoint(directory) is None:
        return None
    return restore_checkpoint(model, directory)


def _save(model, directory, step):
    save_checkpoint(model, directory, step=step)
    sys.stderr.write(f"tfpar: preempted; saved step {step} to {directory}\n")


class PreemptionCheckpoint(keras.callbacks.Callback):
    """On SIGTERM/SIGINT: all hosts save at one agreed step, then stop.

    For `model.fit`; a custom `strategy.run` loop uses
    `tfpar.on_preemption`.

    Args:
        directory: the checkpoint directory every host sees (as for
            `tfpar.save_checkpoint`).
        resume: restore the latest checkpoint of `directory`, if there is
            one, when training begins.
        signals: the signals that mean preemption (not SIGKILL/SIGSTOP).

    Each `fit` it is given to is a run of its own (module docstring):
    `preempted`, `saved_step` and `restored_step` are that run's, and its
    steps are counted from `restored_step` (0 when none was restored).
    """

    def __init__(self, directory, resume=True, signals=SIGNALS):
        super().__init__()
        self.signals = _check_arguments("PreemptionCheckpoint", directory,
                                        resume, signals)
        self.directory = directory
        self.resume = resume
        self.preempted = False
        self.saved_step = None
        self.restored_step = None
        self._agreement = PreemptionAgreement(self.signals)
        _compat.install_group("preemption", PATCHES, None)

    @property
    def requested(self):
        """Whether a preemption signal (or a peer's notice) came."""
        return self._agreement.requested

    def on_train_begin(self, logs=None):
        _RUNNING.add(self)
        _start_run(self)

    def on_train_batch_end(self, batch, logs=None):
        if self.preempted or not self._agreement.step_end():
            return
        self.saved_step = self._agreement.completed
        _save(self.model, self.directory, self.saved_step)
        self.preempted = True
        self.model.stop_training = True

    def on_train_end(self, logs=None):
        _RUNNING.discard(self)
        self._agreement.uninstall()


class PreemptionGuard:
    """`tfpar.on_preemption`'s context manager for a custom loop.

    Inside `with`: this host's signal handlers (the previous ones back on
    exit) and its peer hook. The loop reports each finished step with
    `step_end()`, which returns True (after saving) at the agreed step.

    Attributes:
        restored_step: the step restored on entering (None: none was).
        start_step: the first step to run (`restored_step` or 0).
        step: the steps finished (`start_step` plus those reported).
        requested: a preemption signal (or a peer's notice) came.
        preempted, saved_step: whether it saved, and at which step.

    Each `with` is a run of its own: entering again (after exiting)
    restores, counts and agrees afresh, as a new guard would.
    """

    def __init__(self, directory, model, resume=True, signals=SIGNALS):
        signals = _check_arguments("PreemptionGuard", directory, resume,
                                   signals)
        _check_model("PreemptionGuard", model)
        self.directory = directory
        self.model = model
        self.resume = resume
        self.preempted = False
        self.saved_step = None
        self.restored_step = None
        self._agreement = PreemptionAgreement(signals)
        self._inside = False

    @property
    def requested(self):
        return self._agreement.requested

    @property
    def step(self):
        return self._agreement.completed

    @property
    def start_step(self):
        return self.restored_step or 0

    def __enter__(self):
        if self._inside:
            raise RuntimeError(
                "This tfpar.on_preemption(...) guard is already entered: "
                "one `with` at a time (a nested loop needs its own guard).")
        _start_run(self)
        self._inside = True
        return self

    def __exit__(self, *exc_info):
        self._inside = False
        self._agreement.uninstall()
        return False

    def step_end(self):
        """Reports a finished training step (every host calls it after
        each step). True: stop the loop (the agreed step was saved, now or
        before)."""
        if not self._inside:
            raise RuntimeError(
                "step_end() is called inside `with tfpar.on_preemption("
                "directory, model) as guard:` (its signal handlers and "
                "resume are installed on entering).")
        if self.preempted:
            return True
        if host_watch.current() is not None:
            _wait_for_dispatched_steps()
        if not self._agreement.step_end():
            return False
        self.saved_step = self._agreement.completed
        _save(self.model, self.directory, self.saved_step)
        self.preempted = True
        return True


def _wait_for_dispatched_steps():
    """Blocks until every op this host dispatched has run. TF runs a
    DTensor step asynchronously (the call returns before its collectives
    complete), so without this wait a custom loop's count of finished
    steps runs ahead of the steps' collectives, and the agreement's
    argument (module docstring) fails. Python's lock is released while
    waiting: a peer's proposal is taken meanwhile."""
    _compat.async_wait()


def on_preemption(directory, model, resume=True, signals=SIGNALS):
    """Saves a custom training loop on SIGTERM/SIGINT, every host at one
    agreed step, and resumes from it: `PreemptionCheckpoint` for loops.

    Entering restores the latest checkpoint of `directory` (if any;
    `guard.restored_step`, `guard.start_step`) and installs the signal
    handlers (the previous ones are back on exit). The loop calls
    `guard.step_end()` after every step, on every host: it returns True
    at the agreed step, after `tfpar.save_checkpoint(model, directory,
    step=...)` (the model's weights and `model.optimizer`'s state: compile
    the model with the optimizer the loop applies), and the loop stops.
    Steps are counted from the restored step; on several hosts
    `step_end()` first waits for the work this host dispatched (one sync
    per step, as `fit` does there). On several hosts a signal
    within the loop's last two steps saves nothing (`guard.requested`: the
    script's own final save applies).

    Example:

    >>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2}))
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)),
    ...                               keras.layers.Dense(1)])
    ...     model.compile(optimizer="adam", loss="mse")
    >>> def train_step(x, y):
    ...     with tf.GradientTape() as tape:
    ...         loss = tf.reduce_mean(tf.square(model(x) - y))
    ...     grads = tape.gradient(loss, model.trainable_variables)
    ...     model.optimizer.apply_gradients(
    ...         zip(grads, model.trainable_variables))
    >>> step_fn = tf.function(lambda x, y: strategy.run(train_step, (x, y)))
    >>> x, y = np.ones((800, 4), "float32"), np.ones((800, 1), "float32")
    >>> data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    >>> with tfpar.on_preemption("/tmp/run/preempt", model) as guard:
    ...     batches = strategy.experimental_distribute_dataset(
    ...         data.skip(guard.start_step))  # on from the restored step
    ...     for inputs, targets in batches:
    ...         step_fn(inputs, targets)
    ...         if guard.step_end():  # saved at the agreed step: stop
    ...             break
    >>> guard.preempted, guard.step   # no signal came
    (False, 100)

    Args:
        directory: the checkpoint directory every host sees.
        model: the Keras model the loop trains (and its `optimizer`).
        resume: restore the latest checkpoint of `directory` on entering.
        signals: the signals that mean preemption.

    Returns:
        A `PreemptionGuard` to use in `with`.
    """
    signals = _check_arguments("on_preemption", directory, resume, signals)
    _check_model("on_preemption", model)
    return PreemptionGuard(directory, model, resume, signals)
