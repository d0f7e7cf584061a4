"""Python commands the tests start, run in a fork of the test process instead of a fresh interpreter.

A fresh `python benchmark.py ...` spends most of a tiny run importing the stack (torch, Composer,
diffusers, transformers, Streaming): beside the suite's two workers a two-batch tiny run took 34 s as a new
process and 6 s as a fork of a process that had imported them. The test process has imported all of it, so
`PreloadedPopen` forks it and runs the command in the child as the interpreter would have run it: the
same argv, `__main__`, working directory, environment, standard streams, exit status, and atexit handlers
of the command's own. A command the child starts the same way (Composer's launcher starting its ranks,
gpu_report.py starting its rows) forks too, so a two-rank launch imports nothing at all.

What a fork does not give, and where the real interpreter is used instead (`fresh_reason`): a command
that is not `python SCRIPT|-m MODULE|-c CODE`, an environment that changes what an import reads
(`IMPORT_TIME_ENV`), a start from another thread than the main one (a fork copies one thread; a lock
another thread held, inside torch say, would stay held in the child forever), a test process in which autograd
has started its device threads (torch refuses a backward in any fork of it), and `T2IBENCH_TEST_FRESH=1`
in the environment (every command exec'd, as before: the way to tell a fork's difference from a bug).
Modules stay as the test process imported them, so a test whose subject is a new process (what it imports,
tests/commands/test_stack.py; its memory, bench/bench_ema.py's figures) starts it with subprocess.
"""
from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
import warnings

# Environment variables read when a module is imported (huggingface_hub's offline switch and cache folders,
# torch's kernel choice and thread count, Python's own): a command whose environment sets one of these
# differently from the test process's needs a fresh interpreter to see it. The thread count also because
# libgomp is not fork-safe: a child that runs more OpenMP threads than a parent that used its pool hangs.
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT",
                   "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "TORCH_HOME", "ATEN_CPU_CAPABILITY",
                   "ONEDNN_MAX_CPU_ISA", "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED", "HOME",
                   "PYTHONSAFEPATH", "COVERAGE_PROCESS_START")
FRESH = "T2IBENCH_TEST_FRESH"
TORCH_DEFAULT_SEED = 67280421310721  # the seed of torch's default generator in a new process


def command_of(args: list[str]) -> tuple[str, str, list[str]] | None:
    """("path" | "module" | "code", target, argv) for `python SCRIPT|-m MODULE|-c CODE ARGS...` run by this
    interpreter; None for anything else."""
    if len(args) < 2 or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    first, rest = os.fspath(args[1]), [os.fspath(a) for a in args[2:]]
    if first == "-m" and rest:
        return "module", rest[0], rest  # argv[0] is set to the module's file by runpy
    if first == "-c" and rest:
        return "code", rest[0], ["-c", *rest[1:]]
    if first.startswith("-"):
        return None
    return "path", first, [first, *rest]


def shadowed_modules(env: dict) -> list[str]:
    """Modules this process imported that the environment's PYTHONPATH would find elsewhere first (a copy of
    a package with a file changed, say): a fork would run the ones imported here."""
    known = {os.path.realpath(p) for p in sys.path if p}
    found = []
    for entry in os.fsdecode(env.get("PYTHONPATH", "")).split(os.pathsep):
        folder = os.path.realpath(entry) if entry else ""
        if not folder or folder in known or not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            module = name[:-3] if name.endswith(".py") else name
            if module in sys.modules and (name.endswith(".py") or os.path.isdir(os.path.join(folder, name))):
                found.append(module)
    return found


def fresh_reason(args, env: dict | None, shell: bool, path_copies_loaded_code: bool = False) -> str | None:
    """Why this command needs a fresh interpreter, or None if a fork runs it as one would."""
    if shell or isinstance(args, (str, bytes, os.PathLike)):
        return "a shell or a single string"
    if command_of(list(args)) is None:
        return "not python SCRIPT, -m MODULE or -c CODE"
    if os.environ.get(FRESH) == "1" or (env or {}).get(FRESH) == "1":
        return f"{FRESH}=1"
    if threading.current_thread() is not threading.main_thread():
        return "started from another thread than the main one"
    if _autograd_threads_started():
        return "autograd's device threads run in the test process"
    if env is not None:
        changed = [name for name in IMPORT_TIME_ENV if env.get(name) != os.environ.get(name)]
        if changed:
            return f"the environment sets {', '.join(changed)} otherwise"
        shadowed = [] if path_copies_loaded_code else shadowed_modules(env)
        if shadowed:
            return f"PYTHONPATH finds {', '.join(shadowed[:3])} elsewhere"
    return None


def _autograd_threads_started() -> bool:
    """Whether autograd has started its device threads in this process (threads named pt_autograd_N). torch then
    marks every fork of it, and a backward in the fork refuses to run ("Unable to handle autograd's threading in
    combination with fork-based multiprocessing"). torch 2.14's FSDP2 starts them on a CPU (tests/train/test_fsdp.py's
    in-process steps); torch 2.7's does not."""
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return False
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread}/comm") as name:
                if name.read().startswith("pt_autograd_"):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


class PreloadedPopen(subprocess.Popen):
    """subprocess.Popen that runs `python ...` commands in a fork of this process (see the module's docstring).
    `path_copies_loaded_code=True`: the environment's PYTHONPATH names a copy of the code this process loaded
    (tests/test_readme.py's copy of the repository), which the fork may run as loaded here."""

    def __init__(self, args, *popen_args, path_copies_loaded_code: bool = False, **kwargs):
        self.path_copies_loaded_code = path_copies_loaded_code
        super().__init__(args, *popen_args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        if (fresh_reason(args, env, shell, self.path_copies_loaded_code) or executable is not None
                or preexec_fn is not None or gid is not None or gids is not None or uid is not None
                or process_group != -1):
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                                          process_group)
        kind, target, argv = command_of(list(args))
        _interpreter_path()  # asked once, here: the child would start a process for it every time
        for stream in (sys.stdout, sys.stderr):  # or the child would write what is buffered here again
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_in_child(kind, target, argv, cwd, env, (p2cread, c2pwrite, errwrite), start_new_session,
                                     umask)
            finally:
                os._exit(code)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _run_in_child(kind: str, target: str, argv: list[str], cwd, env, stdio: tuple[int, int, int],
                  start_new_session: bool, umask: int) -> int:
    """Become the command's process, run it, return its exit status (the child's whole life)."""
    # Whatever the test process left for its collector stays uncollected here: an object's finaliser run in this
    # copy would act on the test process's resources (a DataLoader iterator's stops its workers; a
    # StreamingDataset's releases its shared-memory registration).
    gc.freeze()
    if start_new_session:
        os.setsid()
    if umask >= 0:
        os.umask(umask)
    for fd, target_fd in zip(stdio, (0, 1, 2)):
        if fd != -1 and fd != target_fd:
            os.dup2(fd, target_fd)
    for signum in (signal.SIGTERM, signal.SIGALRM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update({os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                                   write_through=unbuffered, line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", write_through=True)
    _as_a_new_interpreter(kind, target)
    sys.argv = argv
    code = 0
    try:
        if kind == "path":
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            with warnings.catch_warnings():  # a new interpreter had not imported it: here it is, and stays
                warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package",
                                        RuntimeWarning)
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except BaseException:  # what the interpreter prints for an uncaught exception, and its status
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # a fresh interpreter waits for its non-daemon threads, then runs atexit
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _print_warning(message: warnings.WarningMessage) -> None:
    """What the warnings module does with a warning to show (warnings._showwarnmsg_impl)."""
    out = message.file or sys.stderr
    if out is not None:
        try:
            out.write(warnings._formatwarnmsg(message))
        except OSError:
            pass


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _as_a_new_interpreter(kind: str, target: str) -> None:
    """Undo what the test process changed that a new interpreter would not have: sys.path, logging's
    handlers, warnings filters, atexit handlers, random state, dynamo's caches, and a subprocess.Popen of
    its own for the commands this one starts."""
    first = os.path.dirname(os.path.abspath(target)) if kind == "path" else os.getcwd()
    from_env = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *from_env, *_interpreter_path()]
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    # pytest records warnings, unraisable exceptions and thread exceptions in lists while a test runs: a new
    # interpreter prints them.
    warnings.showwarning = warnings._showwarning_orig
    warnings._showwarnmsg_impl = _print_warning
    sys.unraisablehook = sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    warnings.resetwarnings()
    for action, category in (("ignore", ImportWarning), ("ignore", ResourceWarning),
                             ("ignore", PendingDeprecationWarning), ("ignore", DeprecationWarning)):
        warnings.simplefilter(action, category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    if os.environ.get("PYTHONWARNINGS"):
        warnings._processoptions(os.environ["PYTHONWARNINGS"].split(","))
    atexit._clear()
    if "multiprocessing.util" in sys.modules:
        # As multiprocessing's own forked children do: none of the test process's children (its loader workers)
        # or finalisers are this process's, and its exit function, registered at an import that happened
        # in the test process, is this one's too.
        process, util = sys.modules["multiprocessing.process"], sys.modules["multiprocessing.util"]
        process._children = set()
        util._finalizer_registry.clear()
        util._run_after_forkers()
        atexit.register(util._exit_function)
    subprocess.Popen = PreloadedPopen
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.manual_seed(TORCH_DEFAULT_SEED)
        threads = os.environ.get("OMP_NUM_THREADS", "")  # the test process's own (IMPORT_TIME_ENV)
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


_INTERPRETER_PATH: list[str] = []


def _interpreter_path() -> list[str]:
    """sys.path of a new interpreter after its first entry (the standard library and site-packages)."""
    if not _INTERPRETER_PATH:
        import json
        # -E: without PYTHONPATH (the child adds its own); and not a command this module forks
        out = subprocess.run([sys.executable, "-E", "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                             capture_output=True, text=True, check=True).stdout
        _INTERPRETER_PATH.extend(json.loads(out))
    return _INTERPRETER_PATH


def run(args: list[str], *, timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with PreloadedPopen (capture_output, text, env, cwd, ... as there)."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    check = kwargs.pop("check", False)
    with PreloadedPopen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result
