//! Per-file order under several service threads.
//!
//! The kernel's ucma runs a file's commands one at a time (`file->mut`) and commands of
//! different files side by side. [`Lanes`] gives the service's threads the same rule:
//! a job (a request) for a file runs at once on the thread that took it when no thread
//! is running one of that file; otherwise it queues behind, in arrival order, and the
//! thread running the file's lane runs it next. A thread running a lane never waits for
//! another file's lane, so one slow request holds up only its own file.
//!
//! The table sits under the service's lock; the jobs run outside it as far as they
//! can (see `server.rs`).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Running and queued jobs by key (the file).
#[derive(Debug)]
pub struct Lanes<K, J> {
    /// Keys a thread is running a job of, with the jobs queued behind it.
    busy: HashMap<K, VecDeque<J>>,
}

impl<K, J> Default for Lanes<K, J> {
    fn default() -> Self {
        Lanes {
            busy: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq + Copy, J> Lanes<K, J> {
    /// A job of `key` arrived: `Some(job)` when the caller is to run it now (the lane
    /// is now the caller's until [`Lanes::next`] returns `None`); `None` when it queued
    /// behind the job running.
    pub fn admit(&mut self, key: K, job: J) -> Option<J> {
        match self.busy.get_mut(&key) {
            Some(q) => {
                q.push_back(job);
                None
            }
            None => {
                self.busy.insert(key, VecDeque::new());
                Some(job)
            }
        }
    }

    /// The lane's runner finished a job of `key`: the next one to run, or `None` when
    /// none is queued (the lane is free again).
    pub fn next(&mut self, key: K) -> Option<J> {
        let q = self.busy.get_mut(&key)?;
        match q.pop_front() {
            Some(j) => Some(j),
            None => {
                self.busy.remove(&key);
                None
            }
        }
    }

    /// Jobs queued behind running ones (for `stat`).
    pub fn queued(&self) -> usize {
        self.busy.values().map(VecDeque::len).sum()
    }

    /// Lanes being run.
    pub fn running(&self) -> usize {
        self.busy.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// Runs `job` for `key` the way the service's threads do: admit under the lock,
    /// run outside it, take the lane's next job until none is left.
    fn serve<K: Hash + Eq + Copy, J>(
        lanes: &Mutex<Lanes<K, J>>,
        key: K,
        job: J,
        mut run: impl FnMut(J),
    ) {
        let first = lanes.lock().map(|mut l| l.admit(key, job)).ok().flatten();
        let mut job = first;
        while let Some(j) = job {
            run(j);
            job = lanes.lock().ok().and_then(|mut l| l.next(key));
        }
    }

    #[test]
    fn a_second_job_of_a_busy_lane_queues_and_runs_next_in_order() {
        let mut l: Lanes<u64, u32> = Lanes::default();
        assert_eq!(l.admit(1, 10), Some(10));
        assert_eq!(l.admit(1, 11), None);
        assert_eq!(l.admit(1, 12), None);
        assert_eq!(l.admit(2, 20), Some(20), "another file runs at once");
        assert_eq!((l.running(), l.queued()), (2, 2));
        assert_eq!(l.next(1), Some(11));
        assert_eq!(l.next(1), Some(12));
        assert_eq!(l.next(1), None);
        assert_eq!(l.admit(1, 13), Some(13), "a free lane runs at once again");
        assert_eq!(l.next(2), None);
        assert_eq!(l.next(1), None);
        assert_eq!((l.running(), l.queued()), (0, 0));
        assert_eq!(l.next(3), None, "a lane nobody ran");
    }

    /// File A's job blocks (a slow command); file B's jobs, taken by another thread,
    /// complete meanwhile; A's next job waits for A's first and then runs.
    #[test]
    fn a_slow_job_of_one_file_does_not_hold_up_another_file() {
        let lanes: Arc<Mutex<Lanes<u64, &'static str>>> = Arc::default();
        let done: Arc<Mutex<Vec<&'static str>>> = Arc::default();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let (started_tx, started_rx) = mpsc::channel::<()>();
        let a = {
            let (lanes, done) = (lanes.clone(), done.clone());
            std::thread::spawn(move || {
                serve(&lanes, 1, "a1", |j| {
                    if j == "a1" {
                        let _ = started_tx.send(());
                        let _ = release_rx.recv_timeout(Duration::from_secs(20));
                    }
                    done.lock().expect("lock").push(j);
                });
            })
        };
        started_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("a1 started");
        // Another thread takes a2 (queued behind a1) and B's two jobs.
        let ran_here = Arc::new(Mutex::new(Vec::new()));
        for (key, job) in [(1u64, "a2"), (2, "b1"), (2, "b2")] {
            let r = ran_here.clone();
            serve(&lanes, key, job, |j| {
                r.lock().expect("lock").push(j);
                done.lock().expect("lock").push(j);
            });
        }
        assert_eq!(
            *done.lock().expect("lock"),
            vec!["b1", "b2"],
            "B completed while A's first job is still running; A's second waits"
        );
        release_tx.send(()).expect("release a1");
        a.join().expect("thread a");
        assert_eq!(*done.lock().expect("lock"), vec!["b1", "b2", "a1", "a2"]);
        assert_eq!(
            *ran_here.lock().expect("lock"),
            vec!["b1", "b2"],
            "a2 ran on A's lane runner, after a1"
        );
    }

    /// Eight threads take the jobs of four files as they come; each file's jobs run one
    /// at a time and in arrival order.
    #[test]
    fn per_file_order_holds_with_many_threads() {
        const FILES: u64 = 4;
        const PER_FILE: u64 = 300;
        let lanes: Arc<Mutex<Lanes<u64, u64>>> = Arc::default();
        let arrivals: Arc<Mutex<VecDeque<(u64, u64)>>> = Arc::new(Mutex::new(
            (0..PER_FILE)
                .flat_map(|n| (0..FILES).map(move |f| (f, n)))
                .collect(),
        ));
        let running: Arc<Vec<AtomicUsize>> =
            Arc::new((0..FILES).map(|_| AtomicUsize::new(0)).collect());
        let seen: Arc<Mutex<Vec<Vec<u64>>>> =
            Arc::new(Mutex::new(vec![Vec::new(); FILES as usize]));
        let overlaps = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (lanes, arrivals, running, seen, overlaps) = (
                    lanes.clone(),
                    arrivals.clone(),
                    running.clone(),
                    seen.clone(),
                    overlaps.clone(),
                );
                std::thread::spawn(move || {
                    loop {
                        // Taking the next arrival and admitting it is one step, as
                        // reading a request and queueing it is for the service.
                        let mut a = arrivals.lock().expect("lock");
                        let Some((f, n)) = a.pop_front() else { break };
                        let first = lanes.lock().expect("lock").admit(f, n);
                        drop(a);
                        let mut job = first;
                        while let Some(n) = job {
                            if running[f as usize].fetch_add(1, Ordering::SeqCst) != 0 {
                                overlaps.fetch_add(1, Ordering::SeqCst);
                            }
                            seen.lock().expect("lock")[f as usize].push(n);
                            std::thread::yield_now();
                            running[f as usize].fetch_sub(1, Ordering::SeqCst);
                            job = lanes.lock().expect("lock").next(f);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(
            overlaps.load(Ordering::SeqCst),
            0,
            "a file ran two jobs at once"
        );
        let want: Vec<u64> = (0..PER_FILE).collect();
        for (f, s) in seen.lock().expect("lock").iter().enumerate() {
            assert_eq!(s, &want, "file {f}'s jobs out of order");
        }
        let l = lanes.lock().expect("lock");
        assert_eq!((l.running(), l.queued()), (0, 0));
    }
}
