//! Locks that outlive a panic. A worker that panics while holding a lock
//! poisons it; dmkit takes the data back rather than spreading that panic to
//! every thread that touches the same state (the panic itself is caught and
//! reported by [`crate::panics`], which fails the device it hit). Every lock,
//! condition-variable wait and `get_mut` in dmkit goes through [`Unpoison`].
//!
//! The threads targets start, their condition waits, sleeps and clocks go
//! through [`spawn`], [`Cond`], [`sleep`] and [`now`]: the standard library's
//! everywhere, except on the threads of a crash trial, where the trial's
//! [`sched::Sched`] runs them one at a time in the seed's order.

pub mod sched;

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The value of a lock operation whether or not the lock was poisoned.
pub trait Unpoison<T> {
    fn unpoisoned(self) -> T;
}

impl<T> Unpoison<T> for Result<T, PoisonError<T>> {
    fn unpoisoned(self) -> T {
        self.unwrap_or_else(PoisonError::into_inner)
    }
}

/// A job for [`Workers`].
pub type Job = Box<dyn FnOnce() + Send>;

/// Threads that take jobs from one shared queue, started at the first job
/// (named `NAME-i`); they end when the pool is dropped. The copier's kcopyd
/// threads and the engine's hook workers are such pools.
pub struct Workers {
    name: &'static str,
    /// How many threads; 0: one per core, at most 8.
    threads: usize,
    queue: std::sync::OnceLock<Option<std::sync::mpsc::Sender<Job>>>,
}

impl Workers {
    pub const fn new(name: &'static str, threads: usize) -> Workers {
        Workers {
            name,
            threads,
            queue: std::sync::OnceLock::new(),
        }
    }

    fn start(&self) -> Option<std::sync::mpsc::Sender<Job>> {
        let n = match self.threads {
            0 => std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .clamp(1, 8),
            n => n,
        };
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let mut started = 0;
        for i in 0..n {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{}-{i}", self.name))
                .spawn(move || loop {
                    let next = rx.lock().unpoisoned().recv();
                    match next {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                });
            started += usize::from(spawned.is_ok());
        }
        if started == 0 {
            tracing::warn!(
                "{}: no worker thread could be started: jobs run on the caller's thread",
                self.name
            );
        }
        (started > 0).then_some(tx)
    }

    /// Run `job` on a worker, or here if no worker could be started. On a
    /// trial's thread the job gets a thread of its own in the trial's
    /// scheduler (the pool's threads are shared by every trial).
    pub fn run(&self, job: Job) {
        if sched::active() {
            if let Err(e) = spawn(self.name, job) {
                tracing::warn!("{}: no thread for a job: {e}", self.name);
            }
            return;
        }
        let job = match self.queue.get_or_init(|| self.start()) {
            Some(tx) => match tx.send(job) {
                Ok(()) => return,
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        };
        job();
    }
}

/// A condition variable that takes part in a trial's scheduler: the mutex a
/// wait releases is passed beside its guard (the scheduler releases it while
/// other threads run, and takes it again).
#[derive(Debug, Default)]
pub struct Cond(Condvar);

impl Cond {
    pub const fn new() -> Cond {
        Cond(Condvar::new())
    }

    fn key(&self) -> usize {
        self as *const Cond as usize
    }

    /// Wait for a notification; `g` is `m`'s guard. May wake spuriously.
    pub fn wait<'a, T>(&self, m: &'a Mutex<T>, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        match sched::running_me() {
            Some((s, me)) => {
                drop(g);
                s.block(me, self.key(), None);
                m.lock().unpoisoned()
            }
            None => self.0.wait(g).unpoisoned(),
        }
    }

    /// Wait for a notification or `timeout`; true if the time ended the wait.
    pub fn wait_timeout<'a, T>(
        &self,
        m: &'a Mutex<T>,
        g: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        match sched::running_me() {
            Some((s, me)) => {
                drop(g);
                let timed_out = s.block(me, self.key(), Some(timeout));
                (m.lock().unpoisoned(), timed_out)
            }
            None => {
                let (g, r) = self.0.wait_timeout(g, timeout).unpoisoned();
                (g, r.timed_out())
            }
        }
    }

    pub fn notify_one(&self) {
        sched::wake(self.key(), false);
        self.0.notify_one();
    }

    pub fn notify_all(&self) {
        sched::wake(self.key(), true);
        self.0.notify_all();
    }
}

/// Lock `m`, for a lock its holder may keep across a wait ([`Cond`], a
/// drain): on a trial's thread a lock held by a thread that waits is waited
/// for in the scheduler (the holder gets its turn), never by blocking the
/// thread that has the turn.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    if !sched::active() {
        return m.lock().unpoisoned();
    }
    loop {
        match m.try_lock() {
            Ok(g) => return g,
            Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                sched::wait_for(m as *const Mutex<T> as usize, Some(Duration::from_micros(50)));
            }
        }
    }
}

/// Sleep for `d` (virtual time on a trial's thread).
pub fn sleep(d: Duration) {
    match sched::running_me() {
        Some((s, me)) => {
            s.block(me, sched::SLEEP_KEY, Some(d));
        }
        None => std::thread::sleep(d),
    }
}

/// The time now (the trial's virtual time on a trial's thread).
pub fn now() -> Instant {
    match sched::me() {
        Some((s, _)) => s.now(),
        None => Instant::now(),
    }
}

/// The wall clock, in nanoseconds since the Unix epoch (what a target
/// stamps on disk); on a trial's thread a fixed date plus the trial's virtual
/// time, so the trial replays from its seed.
pub fn wall_ns() -> u64 {
    match sched::me() {
        Some((s, _)) => 1_800_000_000_000_000_000 + s.clock().as_nanos() as u64,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    }
}

/// The time since `t`, by [`now`].
pub fn since(t: Instant) -> Duration {
    now().saturating_duration_since(t)
}

/// A [`reply`]'s answer (once sent) and whether the sender is gone, and the
/// condition the receiver waits on.
type ReplyCell<T> = std::sync::Arc<(Mutex<(Option<T>, bool)>, Cond)>;

/// The sending end of a [`reply`]: one value, or none if it is dropped first.
#[derive(Debug)]
pub struct ReplyTx<T>(ReplyCell<T>);

/// The receiving end of a [`reply`].
#[derive(Debug)]
pub struct ReplyRx<T>(ReplyCell<T>);

/// A channel for one answer from another thread (a worker's to a request),
/// whose wait takes part in a trial's scheduler.
pub fn reply<T>() -> (ReplyTx<T>, ReplyRx<T>) {
    let shared = std::sync::Arc::new((Mutex::new((None, false)), Cond::new()));
    (ReplyTx(shared.clone()), ReplyRx(shared))
}

impl<T> ReplyTx<T> {
    pub fn send(self, v: T) {
        self.0 .0.lock().unpoisoned().0 = Some(v);
        // the drop says it is there
    }
}

impl<T> Drop for ReplyTx<T> {
    fn drop(&mut self) {
        self.0 .0.lock().unpoisoned().1 = true;
        self.0 .1.notify_all();
    }
}

impl<T> ReplyRx<T> {
    /// The answer; None if the sender went without one.
    pub fn recv(self) -> Option<T> {
        let (m, cv) = &*self.0;
        let mut g = m.lock().unpoisoned();
        while !g.1 {
            g = cv.wait(m, g);
        }
        g.0.take()
    }
}

/// A thread started by [`spawn`].
#[derive(Debug)]
pub struct Thread<T> {
    handle: std::thread::JoinHandle<T>,
    /// Its scheduler and number there, when it takes part in one.
    part: Option<(std::sync::Arc<sched::Sched>, usize)>,
}

impl<T> Thread<T> {
    /// Wait for the thread to end (a trial's thread hands the turn on meanwhile).
    pub fn join(self) -> std::thread::Result<T> {
        if let (Some((s, id)), Some((mine, me))) = (&self.part, sched::me()) {
            if std::sync::Arc::ptr_eq(s, &mine) {
                while !s.exited(*id) {
                    s.block(me, sched::exit_key(*id), None);
                }
            }
        }
        self.handle.join()
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }
}

/// Start a thread named `name`. Started from a trial's thread, it takes part
/// in the trial's scheduler (it runs when the scheduler gives it the turn).
pub fn spawn<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<Thread<T>> {
    let b = std::thread::Builder::new().name(name.to_string());
    let Some((s, _)) = sched::running_me() else {
        return Ok(Thread {
            handle: b.spawn(f)?,
            part: None,
        });
    };
    let id = s.add(name);
    let s2 = s.clone();
    match b.spawn(move || {
        let _part = sched::Part::start(s2, id);
        f()
    }) {
        Ok(handle) => Ok(Thread {
            handle,
            part: Some((s, id)),
        }),
        Err(e) => {
            s.exit(id);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn a_poisoned_lock_still_gives_its_data() {
        let m = Arc::new(Mutex::new(7));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unpoisoned();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*m.lock().unpoisoned(), 7);
    }
}
