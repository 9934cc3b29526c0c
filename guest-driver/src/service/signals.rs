//! What a signal to a thread blocked in GET_EVENT asks of the service.
//!
//! The kernel's ucma waits for an event with `wait_event_interruptible` and returns
//! `-ERESTARTSYS` when a signal comes: a stop (SIGSTOP, Ctrl-Z), a ptrace attach and a
//! handler installed with SA_RESTART restart the `write()` transparently; a handler
//! without SA_RESTART sees EINTR; a fatal signal kills.
//!
//! Over CUSE the blocked `write()` is a FUSE request, and FUSE (`fs/fuse/dev.c`,
//! `request_wait_answer`) ends its interruptible wait on any signal, sends INTERRUPT and
//! then waits *killably* for the answer: the thread can no longer stop, run a handler or
//! be traced until the server answers, and the server cannot answer `-ERESTARTSYS`
//! (`fuse_dev_do_write` refuses errors of -512 and below). So the service answers at
//! once, and what it answers depends on the signal, read from the thread's
//! `/proc/<tid>/status` (the FUSE header's `pid` is the thread ID; the signal is still
//! pending there, since the thread has not returned to user space yet):
//!
//! - a fatal signal (SIGKILL pending, which is also what a default-action terminating
//!   signal becomes, or the thread already exiting or gone): EINTR; the process dies
//!   and its file's release frees its ids;
//! - anything else (a stop, a ptrace stop, a caught signal, or nothing visible: a
//!   PTRACE_INTERRUPT or the freezer): [`Answer::Restart`], the restart event
//!   (`abi::EventResp::restart`), which librdmacm discards and answers with a new
//!   GET_EVENT. The thread returns to user space, stops, is traced or runs its handler
//!   there, then waits again: a restart, as `-ERESTARTSYS` gives.
//!
//! What cannot be told from /proc is whether a caught signal's handler has SA_RESTART
//! (`sigaction` flags are not exported): a handler without it runs, and the call then
//! waits on instead of failing with EINTR.

/// A signal number's bit in the /proc masks.
fn bit(sig: i32) -> u64 {
    1u64 << (sig - 1)
}

/// Signals whose default action is not to terminate: ignored by default or stops.
fn default_not_fatal() -> u64 {
    [
        libc::SIGCHLD,
        libc::SIGCONT,
        libc::SIGURG,
        libc::SIGWINCH,
        libc::SIGSTOP,
        libc::SIGTSTP,
        libc::SIGTTIN,
        libc::SIGTTOU,
    ]
    .iter()
    .fold(0, |m, &s| m | bit(s))
}

/// Stop signals.
fn stops() -> u64 {
    [libc::SIGSTOP, libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU]
        .iter()
        .fold(0, |m, &s| m | bit(s))
}

/// A thread's signal state, as `/proc/<tid>/status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThreadSignals {
    /// The state letter (`S`, `D`, `T`, `t`, `Z`, `X`, ...).
    pub state: char,
    /// The tracer's PID (0: not traced).
    pub tracer: u32,
    /// Pending for the thread (`SigPnd`) or its process (`ShdPnd`).
    pub pending: u64,
    /// Blocked (`SigBlk`).
    pub blocked: u64,
    /// Ignored (`SigIgn`).
    pub ignored: u64,
    /// Caught: a handler is installed (`SigCgt`).
    pub caught: u64,
}

impl ThreadSignals {
    /// Reads the text of a `/proc/<tid>/status`; `None` if a field is missing or
    /// unreadable.
    pub fn parse(status: &str) -> Option<ThreadSignals> {
        let mut s = ThreadSignals::default();
        let mut seen = 0u8;
        for line in status.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            let mask = || u64::from_str_radix(value, 16).ok();
            match key {
                "State" => {
                    s.state = value.chars().next()?;
                    seen |= 1;
                }
                "TracerPid" => {
                    s.tracer = value.parse().ok()?;
                    seen |= 2;
                }
                "SigPnd" | "ShdPnd" => {
                    s.pending |= mask()?;
                    seen |= if key == "SigPnd" { 4 } else { 8 };
                }
                "SigBlk" => {
                    s.blocked = mask()?;
                    seen |= 16;
                }
                "SigIgn" => {
                    s.ignored = mask()?;
                    seen |= 32;
                }
                "SigCgt" => {
                    s.caught = mask()?;
                    seen |= 64;
                }
                _ => {}
            }
        }
        (seen == 127).then_some(s)
    }

    /// The state of thread `tid` now; `None` if it is gone.
    pub fn of_thread(tid: u32) -> Option<ThreadSignals> {
        let text = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
        ThreadSignals::parse(&text)
    }

    /// Pending signals that will be acted on (not blocked; SIGKILL and SIGSTOP cannot
    /// be blocked).
    fn actionable(&self) -> u64 {
        self.pending & (!self.blocked | bit(libc::SIGKILL) | bit(libc::SIGSTOP))
    }

    /// Will the thread die on its return to user space?
    pub fn fatal(&self) -> bool {
        if matches!(self.state, 'X' | 'Z') {
            return true;
        }
        let a = self.actionable();
        if a & bit(libc::SIGKILL) != 0 {
            return true;
        }
        // A traced thread's signals go to its tracer first, which decides.
        let defaulted = a & !self.caught & !self.ignored & !default_not_fatal();
        self.tracer == 0 && defaulted != 0
    }

    /// Why the thread was interrupted, if it is not dying.
    pub fn reason(&self) -> Reason {
        let a = self.actionable();
        if a & self.caught != 0 {
            Reason::Handler
        } else if a & stops() != 0 {
            Reason::Stop
        } else if self.tracer != 0 {
            Reason::Traced
        } else {
            Reason::Unseen
        }
    }
}

/// Why a blocked GET_EVENT was interrupted (for the counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// A stop signal is pending.
    Stop,
    /// A handler will run.
    Handler,
    /// A tracer holds the thread (a ptrace stop).
    Traced,
    /// No signal shows: a PTRACE_INTERRUPT before the tracer is seen, the freezer.
    Unseen,
}

/// The answer to an INTERRUPT of a blocked GET_EVENT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The restart event: librdmacm issues the GET_EVENT again once the thread has
    /// stopped, been traced or run its handler.
    Restart(Reason),
    /// EINTR: the thread dies (or is gone).
    Fatal,
}

/// What to answer a thread in state `s` (`None`: the thread is gone).
pub fn answer(s: Option<&ThreadSignals>) -> Answer {
    match s {
        Some(s) if !s.fatal() => Answer::Restart(s.reason()),
        _ => Answer::Fatal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: &str, tracer: u32, pnd: u64, shd: u64, blk: u64, cgt: u64) -> String {
        format!(
            "Name:\trping\nState:\t{state}\nTgid:\t7\nTracerPid:\t{tracer}\n\
             SigQ:\t0/7823\nSigPnd:\t{pnd:016x}\nShdPnd:\t{shd:016x}\nSigBlk:\t{blk:016x}\n\
             SigIgn:\t0000000000001000\nSigCgt:\t{cgt:016x}\nCapInh:\t0\n"
        )
    }

    fn classify(text: &str) -> Answer {
        answer(ThreadSignals::parse(text).as_ref())
    }

    #[test]
    fn stops_traces_and_handlers_restart() {
        let d = "D (disk sleep)";
        // SIGSTOP to the process (kill -STOP), SIGTSTP (Ctrl-Z) without a handler.
        assert_eq!(
            classify(&status(d, 0, 0, bit(libc::SIGSTOP), 0, 0)),
            Answer::Restart(Reason::Stop)
        );
        assert_eq!(
            classify(&status(d, 0, 0, bit(libc::SIGTSTP), 0, 0)),
            Answer::Restart(Reason::Stop)
        );
        // strace -p: PTRACE_SEIZE + PTRACE_INTERRUPT pend no signal.
        assert_eq!(
            classify(&status(d, 55, 0, 0, 0, 0)),
            Answer::Restart(Reason::Traced)
        );
        // A caught SIGALRM (the handler runs, then the call waits again).
        assert_eq!(
            classify(&status(d, 0, bit(libc::SIGALRM), 0, 0, bit(libc::SIGALRM))),
            Answer::Restart(Reason::Handler)
        );
        // A caught signal wins over a stop: the handler runs first.
        assert_eq!(
            classify(&status(
                d,
                0,
                bit(libc::SIGALRM),
                bit(libc::SIGSTOP),
                0,
                bit(libc::SIGALRM)
            )),
            Answer::Restart(Reason::Handler)
        );
        // The freezer, or a signal already taken by another thread.
        assert_eq!(
            classify(&status(d, 0, 0, 0, 0, 0)),
            Answer::Restart(Reason::Unseen)
        );
        // A terminating signal that is blocked does not end the thread.
        assert_eq!(
            classify(&status(d, 0, 0, bit(libc::SIGTERM), bit(libc::SIGTERM), 0)),
            Answer::Restart(Reason::Unseen)
        );
        // SIGCHLD, SIGWINCH: ignored by default, never fatal.
        assert_eq!(
            classify(&status(
                d,
                0,
                0,
                bit(libc::SIGCHLD) | bit(libc::SIGWINCH),
                0,
                0
            )),
            Answer::Restart(Reason::Unseen)
        );
    }

    #[test]
    fn fatal_signals_and_gone_threads_are_eintr() {
        let d = "D (disk sleep)";
        // SIGTERM with its default action: the kernel pends SIGKILL on every thread.
        assert_eq!(
            classify(&status(d, 0, bit(libc::SIGKILL), bit(libc::SIGTERM), 0, 0)),
            Answer::Fatal
        );
        // SIGKILL cannot be blocked.
        assert_eq!(
            classify(&status(d, 0, bit(libc::SIGKILL), 0, u64::MAX, 0)),
            Answer::Fatal
        );
        // A terminating signal not caught, not ignored, not blocked, no tracer.
        assert_eq!(
            classify(&status(d, 0, 0, bit(libc::SIGUSR1), 0, 0)),
            Answer::Fatal
        );
        // The same under a tracer goes to the tracer first: not fatal yet.
        assert_eq!(
            classify(&status("t (tracing stop)", 9, 0, bit(libc::SIGUSR1), 0, 0)),
            Answer::Restart(Reason::Traced)
        );
        assert_eq!(
            classify(&status("Z (zombie)", 0, 0, 0, 0, 0)),
            Answer::Fatal
        );
        assert_eq!(answer(None), Answer::Fatal, "the thread is gone");
        // An unreadable status is a thread that cannot be helped: EINTR.
        assert_eq!(classify("State:\tS\n"), Answer::Fatal);
        assert_eq!(
            classify(&status(d, 0, 0, 0, 0, 0).replace("SigBlk:\t0", "SigBlk:\tzz")),
            Answer::Fatal
        );
    }

    /// The fields come from the kernel's own /proc: a signal blocked and sent to this
    /// thread shows pending and blocked, and is not fatal.
    #[test]
    fn reads_this_threads_status() {
        // SAFETY: gettid has no arguments and cannot fail.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
        // SAFETY: sigset operations on a local set; pthread_sigmask on this thread only.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR2);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            libc::syscall(
                libc::SYS_tgkill,
                libc::getpid(),
                tid as libc::pid_t,
                libc::SIGUSR2,
            );
        }
        let s = ThreadSignals::of_thread(tid);
        // SAFETY: takes the pending SIGUSR2 back (it is blocked, so sigtimedwait gets it
        // at once) and unblocks it again.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR2);
            let zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            libc::sigtimedwait(&set, std::ptr::null_mut(), &zero);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }
        let s = s.expect("this thread's status");
        assert_ne!(s.pending & bit(libc::SIGUSR2), 0, "{s:?}");
        assert_ne!(s.blocked & bit(libc::SIGUSR2), 0, "{s:?}");
        assert!(!s.fatal(), "{s:?}");
        assert_eq!(s.state, 'R');
    }
}
