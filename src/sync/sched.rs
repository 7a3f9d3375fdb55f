//! A deterministic scheduler for crash trials (`dmkit sim`): the threads of a
//! trial (the trial's own, and every thread a target starts while the trial
//! runs: thin's commit thread, kcopyd's jobs, writecache's writer, ...) take
//! turns, one at a time, and hand the turn on only where they would block (a
//! condition wait, a sleep, a join, an engine waiting for completions). Who
//! runs next is drawn from the trial's seed, and time is virtual: it moves on
//! only when no thread can run and the earliest timed wait ends. So the order
//! of everything the threads do, and each I/O they make, is a function of the
//! seed, and a trial replays from its seed alone.
//!
//! A thread takes part when it enrols ([`Sched::enrol`]) or is started by one
//! that does ([`super::spawn`]); every other thread is untouched (the daemon
//! has no scheduler, and [`super::Cond`], [`super::sleep`], [`super::now`]
//! behave as the standard library's there). Dropping the enrolment dissolves
//! the scheduler: threads still waiting in it go on as ordinary threads.
//!
//! The rule for code that runs under it: a thread must not hand the turn on
//! (wait) while it holds a lock another participant may take, and must not
//! block anywhere but in the waits named above; a wait missed blocks the trial,
//! and the scheduler then says so ([`Sched::stuck`]) and dissolves.

use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// One trial's scheduler.
pub struct Sched {
    st: Mutex<St>,
    /// Threads waiting for their turn wait here.
    turn: Condvar,
    /// Virtual time 0.
    epoch: Instant,
}

struct St {
    threads: Vec<Th>,
    running: Option<usize>,
    /// xorshift64 state: every choice of the next thread.
    rng: u64,
    /// Virtual time since `epoch`.
    clock: Duration,
    dissolved: bool,
    /// Set when no thread could run and none had a timed wait.
    stuck: Option<String>,
}

struct Th {
    name: String,
    state: State,
    /// The last wait ended by its time, not by a wake.
    timed_out: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Runnable,
    Running,
    /// Waiting for a wake of `key`, or for the virtual time `until`.
    Blocked {
        key: usize,
        until: Option<Duration>,
    },
    Exited,
}

thread_local! {
    static ME: RefCell<Option<(Arc<Sched>, usize)>> = const { RefCell::new(None) };
}

/// The scheduler the current thread takes part in, and its number there.
pub(super) fn me() -> Option<(Arc<Sched>, usize)> {
    ME.with(|m| m.borrow().clone())
}

/// The scheduler the current thread takes part in and its number there, while
/// that scheduler runs (None once it is dissolved: the thread is an ordinary
/// one again).
pub(super) fn running_me() -> Option<(Arc<Sched>, usize)> {
    me().filter(|(s, _)| !s.dissolved())
}

/// Whether the current thread takes part in a scheduler that is running.
pub fn active() -> bool {
    ME.with(|m| m.borrow().as_ref().is_some_and(|(s, _)| !s.dissolved()))
}

/// The current thread waits in its scheduler for a [`wake`] of `key` (any
/// number naming what it waits for: an address) or `timeout`; true if the time
/// ended it. Returns at once on a thread that is not [`active`].
pub fn wait_for(key: usize, timeout: Option<Duration>) -> bool {
    match me() {
        Some((s, id)) => s.block(id, key, timeout),
        None => false,
    }
}

/// The current thread lets the scheduler run another runnable thread first (or
/// itself again, as the seed draws). Call it only where the thread holds no
/// lock another thread may take. Nothing on a thread that takes part in none.
pub fn yield_now() {
    if let Some((s, id)) = me() {
        let mut st = s.state();
        if st.dissolved {
            return;
        }
        st.threads[id].state = State::Runnable;
        s.pass(&mut st);
        drop(s.await_turn(st, id));
    }
}

/// Time passes on the current thread's scheduler: between `min` and `max`,
/// drawn from the seed (what an I/O takes on a simulated disk); nothing on a
/// thread that takes part in none. Waits whose time ends meanwhile end at the
/// next turn.
pub fn elapse(min: Duration, max: Duration) {
    if let Some((s, _)) = me() {
        let mut st = s.state();
        let span = max.saturating_sub(min).as_nanos().max(1) as u64;
        let d = min + Duration::from_nanos(crate::rng::step(&mut st.rng) % span);
        st.clock += d;
    }
}

/// Fill `buf` from the current thread's scheduler's seed (a salt made during
/// a trial is then the same in every run of it); false, and `buf` untouched,
/// on a thread that takes part in none (take real randomness there).
pub fn seeded_bytes(buf: &mut [u8]) -> bool {
    match me() {
        Some((s, _)) => {
            let mut st = s.state();
            for b in buf.iter_mut() {
                *b = crate::rng::step(&mut st.rng) as u8;
            }
            true
        }
        None => false,
    }
}

/// Wake the current thread's scheduler's threads waiting for `key`; nothing
/// on a thread that takes part in none.
pub fn wake(key: usize, all: bool) {
    ME.with(|m| {
        if let Some((s, _)) = &*m.borrow() {
            s.wake(key, all);
        }
    });
}

/// The key sleeps wait on (nothing wakes it).
pub(super) const SLEEP_KEY: usize = usize::MAX;

/// A started thread's part in its scheduler: it waits for its first turn, and
/// when it ends (returns or unwinds) it exits and hands the turn on.
pub(super) struct Part(Arc<Sched>, usize);

impl Part {
    pub(super) fn start(s: Arc<Sched>, id: usize) -> Part {
        ME.with(|m| *m.borrow_mut() = Some((s.clone(), id)));
        s.wait_turn(id);
        Part(s, id)
    }
}

impl Drop for Part {
    fn drop(&mut self) {
        ME.with(|m| *m.borrow_mut() = None);
        self.0.exit(self.1);
    }
}

/// The current thread's part in a scheduler; dropping it dissolves the
/// scheduler.
pub struct Enrolment {
    sched: Arc<Sched>,
}

impl Enrolment {
    /// Dissolve the scheduler; what blocked the trial, if it was blocked
    /// ([`Sched::stuck`]).
    pub fn end(self) -> Option<String> {
        let sched = self.sched.clone();
        drop(self);
        sched.stuck()
    }
}

impl Drop for Enrolment {
    fn drop(&mut self) {
        ME.with(|m| *m.borrow_mut() = None);
        self.sched.dissolve();
    }
}

impl std::fmt::Debug for Sched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sched")
    }
}

impl Sched {
    /// A scheduler whose choices follow `seed`.
    pub fn new(seed: u64) -> Arc<Sched> {
        Arc::new(Sched {
            st: Mutex::new(St {
                threads: Vec::new(),
                running: None,
                rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
                clock: Duration::ZERO,
                dissolved: false,
                stuck: None,
            }),
            turn: Condvar::new(),
            epoch: Instant::now(),
        })
    }

    fn state(&self) -> MutexGuard<'_, St> {
        self.st.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The current thread takes part, running (it must be the scheduler's
    /// first thread, and take part in no other).
    pub fn enrol(self: &Arc<Self>, name: &str) -> Enrolment {
        let mut st = self.state();
        let id = st.threads.len();
        st.threads.push(Th {
            name: name.to_string(),
            state: State::Running,
            timed_out: false,
        });
        st.running = Some(id);
        drop(st);
        ME.with(|m| *m.borrow_mut() = Some((self.clone(), id)));
        Enrolment { sched: self.clone() }
    }

    /// What blocked the trial, if it was blocked: every thread waited and none
    /// had a time to wake at.
    pub fn stuck(&self) -> Option<String> {
        self.state().stuck.clone()
    }

    /// Whether the scheduler is gone (its threads run as ordinary ones).
    pub(super) fn dissolved(&self) -> bool {
        self.state().dissolved
    }

    /// The virtual time since the scheduler began.
    pub(super) fn clock(&self) -> Duration {
        self.state().clock
    }

    /// The virtual time now.
    pub(super) fn now(&self) -> Instant {
        self.epoch + self.state().clock
    }

    /// A new thread named `name`, runnable; its number.
    pub(super) fn add(&self, name: &str) -> usize {
        let mut st = self.state();
        st.threads.push(Th {
            name: name.to_string(),
            state: State::Runnable,
            timed_out: false,
        });
        st.threads.len() - 1
    }

    /// Thread `me` (new, or handed the turn back) waits for its turn.
    pub(super) fn wait_turn(&self, me: usize) {
        drop(self.await_turn(self.state(), me));
    }

    /// Wait, releasing the state, until thread `me` has the turn or the
    /// scheduler is dissolved.
    fn await_turn<'a>(&'a self, mut st: MutexGuard<'a, St>, me: usize) -> MutexGuard<'a, St> {
        while st.running != Some(me) && !st.dissolved {
            st = self.turn.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st
    }

    /// Thread `me` waits for a wake of `key` or `timeout` of virtual time;
    /// true if the time ended it. Returns at once (false) once dissolved.
    pub(super) fn block(&self, me: usize, key: usize, timeout: Option<Duration>) -> bool {
        let mut st = self.state();
        if st.dissolved {
            return false;
        }
        let until = timeout.map(|t| st.clock + t);
        st.threads[me].state = State::Blocked { key, until };
        st.threads[me].timed_out = false;
        self.pass(&mut st);
        self.await_turn(st, me).threads[me].timed_out
    }

    /// Wake the threads waiting for `key` (all, or the first of them); the
    /// caller keeps the turn.
    pub(super) fn wake(&self, key: usize, all: bool) {
        wake_in(&mut self.state(), key, all);
    }

    /// Thread `me` ends: the turn goes on, and a join waiting for it wakes.
    pub(super) fn exit(&self, me: usize) {
        let mut st = self.state();
        st.threads[me].state = State::Exited;
        wake_in(&mut st, exit_key(me), true);
        if st.running == Some(me) {
            self.pass(&mut st);
        }
    }

    /// Whether thread `id` has exited (or the scheduler is gone).
    pub(super) fn exited(&self, id: usize) -> bool {
        let st = self.state();
        st.dissolved || st.threads.get(id).is_none_or(|t| t.state == State::Exited)
    }

    /// Hand the turn to the next thread: one of the runnable ones, drawn from
    /// the seed; if none, the timed wait that ends first (the clock moves to
    /// its end); if none either, the trial is stuck and the scheduler
    /// dissolves.
    fn pass(&self, st: &mut St) {
        if st.dissolved {
            return;
        }
        // waits whose time has come end now
        let now = st.clock;
        for t in &mut st.threads {
            if matches!(t.state, State::Blocked { until: Some(u), .. } if u <= now) {
                t.state = State::Runnable;
                t.timed_out = true;
            }
        }
        let runnable: Vec<usize> = (0..st.threads.len())
            .filter(|&i| st.threads[i].state == State::Runnable)
            .collect();
        let next = if runnable.is_empty() {
            let timed = (0..st.threads.len())
                .filter_map(|i| match st.threads[i].state {
                    State::Blocked { until: Some(u), .. } => Some((u, i)),
                    _ => None,
                })
                .min();
            match timed {
                Some((until, i)) => {
                    st.clock = st.clock.max(until);
                    st.threads[i].timed_out = true;
                    i
                }
                None => {
                    let waits: Vec<String> = st
                        .threads
                        .iter()
                        .filter(|t| t.state != State::Exited)
                        .map(|t| t.name.clone())
                        .collect();
                    st.stuck = Some(format!(
                        "every thread of the trial waits and none for a time: {}",
                        waits.join(", ")
                    ));
                    st.dissolved = true;
                    st.running = None;
                    self.turn.notify_all();
                    return;
                }
            }
        } else {
            runnable[(crate::rng::step(&mut st.rng) % runnable.len() as u64) as usize]
        };
        st.threads[next].state = State::Running;
        st.running = Some(next);
        self.turn.notify_all();
    }

    fn dissolve(&self) {
        let mut st = self.state();
        st.dissolved = true;
        st.running = None;
        self.turn.notify_all();
    }
}

/// Make the threads of `st` waiting for `key` runnable (all, or the first).
fn wake_in(st: &mut St, key: usize, all: bool) {
    for t in &mut st.threads {
        if matches!(t.state, State::Blocked { key: k, .. } if k == key) {
            t.state = State::Runnable;
            if !all {
                break;
            }
        }
    }
}

/// The key a join of thread `id` waits on (no address is this small).
pub(super) fn exit_key(id: usize) -> usize {
    id + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::{spawn, Cond};

    /// Three threads append to one list, each waiting on a condition between
    /// its appends: the same seed gives the same list every time, and some
    /// other seed another.
    fn run(seed: u64) -> Vec<u32> {
        let sched = Sched::new(seed);
        let _e = sched.enrol("test");
        let out = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new((Mutex::new(0u32), Cond::new()));
        let mut ts = Vec::new();
        for t in 0..3u32 {
            let (out, gate) = (out.clone(), gate.clone());
            ts.push(
                spawn(&format!("t{t}"), move || {
                    for i in 0..4 {
                        out.lock().unwrap().push(t * 10 + i);
                        let g = gate.0.lock().unwrap();
                        let _ = gate
                            .1
                            .wait_timeout(&gate.0, g, Duration::from_millis(1 + u64::from(t)));
                    }
                })
                .unwrap(),
            );
        }
        for t in ts {
            t.join().unwrap();
        }
        let v = out.lock().unwrap().clone();
        assert!(sched.stuck().is_none());
        v
    }

    #[test]
    fn the_same_seed_gives_the_same_interleaving() {
        let first = run(7);
        assert_eq!(first.len(), 12);
        for _ in 0..20 {
            assert_eq!(run(7), first);
        }
        assert!((0..20).any(|s| run(s) != first), "no seed changes the order");
    }

    #[test]
    fn a_trial_where_every_thread_waits_for_ever_is_named_stuck() {
        let sched = Sched::new(1);
        let e = sched.enrol("test");
        let gate = Arc::new((Mutex::new(()), Cond::new()));
        let g2 = gate.clone();
        let t = spawn("waiter", move || {
            let g = g2.0.lock().unwrap();
            drop(g2.1.wait(&g2.0, g));
        })
        .unwrap();
        // the test thread waits for the waiter, which waits for nobody
        t.join().unwrap();
        let stuck = sched.stuck().unwrap_or_default();
        assert!(stuck.contains("waiter") && stuck.contains("test"), "{stuck}");
        drop(e);
        drop(gate);
    }
}
