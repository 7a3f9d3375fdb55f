//! Reactors: a few I/O threads, each serving many NBD connections.
//!
//! A connection's handshake runs on a short-lived thread of its own (it is a
//! conversation of blocking reads and writes, TLS included, bounded by a
//! deadline and by [`MAX_HANDSHAKES`] at a time); once the client is in the
//! transmission phase the connection is handed to a reactor with the fewest
//! connections, the one on its client's CPU among them, and moves only to
//! follow its client or to even the reactors' loads (`placement`). A reactor owns one request engine (one ring,
//! [`REACTOR_SLOTS`] request slots) shared by all its connections: one wait
//! covers every socket, every backing I/O and every target completion of the
//! thread, and nothing on the fast path takes a lock (requests of a connection
//! never leave its reactor: a connection moves only when it has none). An idle connection costs its socket and its
//! `Conn` (a few hundred bytes); receive buffers and request buffers belong to
//! the reactor and are bounded there.

use super::conn::{self, Conn, NewConn, Shared, TAG_POLL};
use super::placement;
use crate::mapper::engine::{IoEvent, SLOTS_LIMIT};
use crate::mapper::Registry;
use crate::sync::Unpoison;
use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Request slots of one reactor's engine to begin with; it grows to the most an
/// engine can have ([`SLOTS_LIMIT`]: 256 connections' worth, at 256 requests
/// each, of requests under way or with replies their clients have not read).
const REACTOR_SLOTS: usize = 1024;
/// Kernel workers a reactor's ring may use at once for file I/O that cannot
/// complete inline: as many as the connections it replaces used to have in all
/// (each connection thread's ring had the kernel's default, four per CPU).
const IO_WORKERS: u32 = 64;
/// Handshakes under way at once; more clients wait in the listen queue.
pub const MAX_HANDSHAKES: usize = 256;
/// The tag of a reactor's own poll on its door.
const DOOR_TAG: u64 = 0;

/// Where connections are handed to a reactor.
struct Door {
    queue: Mutex<Vec<NewConn>>,
    /// Signalled when the queue has connections.
    efd: OwnedFd,
    /// Connections the reactor serves (the least loaded gets the next one;
    /// shared with the registry's `per_reactor`).
    conns: Arc<AtomicUsize>,
    /// The CPU the reactor is pinned to, once it is.
    cpu: std::sync::OnceLock<usize>,
    /// Its busy connections whose clients were on its CPU at the last check
    /// (the registry's `local`).
    local: Arc<AtomicUsize>,
}

/// The reactors' doors, and what they tell each other to place connections.
struct Placement {
    doors: Vec<Arc<Door>>,
    /// Held while a connection is placed: the least loaded reactor is read
    /// and counted as one step, so connections whose handshakes end at once
    /// do not all read the same least loaded one.
    placing: Mutex<()>,
    /// `wants[a * n + b]`: connections of reactor `a` whose clients run on
    /// reactor `b`'s CPU, as `a` last saw them.
    wants: Vec<AtomicUsize>,
}

impl Placement {
    fn loads(&self) -> Vec<usize> {
        self.doors
            .iter()
            .map(|d| d.conns.load(Ordering::Relaxed))
            .collect()
    }

    fn cpus(&self) -> Vec<Option<usize>> {
        self.doors.iter().map(|d| d.cpu.get().copied()).collect()
    }

    /// The reactor pinned to `cpu` (a few reactors, one a CPU at most).
    fn reactor_on(&self, cpu: Option<usize>) -> Option<usize> {
        let cpu = cpu?;
        self.doors.iter().position(|d| d.cpu.get() == Some(&cpu))
    }

    fn wants(&self, from: usize, to: usize) -> usize {
        self.wants[from * self.doors.len() + to].load(Ordering::Relaxed)
    }

    /// Give `c` to reactor `to`.
    fn hand_to(&self, to: usize, c: NewConn) {
        let door = &self.doors[to];
        door.queue.lock().unpoisoned().push(c);
        let _ = rustix::io::write(&door.efd, &1u64.to_ne_bytes());
    }
}

/// The reactors of a daemon, and the bounds on handshakes.
pub struct Reactors {
    place: Arc<Placement>,
    handshakes: Mutex<usize>,
    handshake_done: Condvar,
    deadlines: Arc<Deadlines>,
}

/// Handshakes under way and when each must be over: a client that trickles
/// its bytes (each read within the socket's timeout) would otherwise hold a
/// handshake for ever, and [`MAX_HANDSHAKES`] of them would keep every new
/// client out. Past its deadline a handshake's socket is shut down, which ends
/// the blocked read.
#[derive(Default)]
struct Deadlines {
    list: Mutex<Vec<(u64, std::time::Instant, OwnedFd)>>,
    next: std::sync::atomic::AtomicU64,
}

/// A handshake's deadline, lifted when this is dropped.
pub struct Deadline<'a> {
    d: &'a Deadlines,
    id: u64,
}

impl Drop for Deadline<'_> {
    fn drop(&mut self) {
        self.d.list.lock().unpoisoned().retain(|e| e.0 != self.id);
    }
}

fn enforce(d: &Deadlines) {
    loop {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = std::time::Instant::now();
        d.list.lock().unpoisoned().retain(|(_, at, fd)| {
            if *at > now {
                return true;
            }
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
            false
        });
    }
}

impl Reactors {
    /// Start `n` reactors (at least one), each pinned to a CPU of its own
    /// while there are no more of them than CPUs this thread may use.
    pub fn start(n: usize, reg: &Arc<Registry>) -> std::io::Result<Arc<Reactors>> {
        let n = n.max(1);
        let allowed = placement::allowed_cpus();
        let pins = allowed.len() >= n;
        let mut doors = Vec::new();
        for _ in 0..n {
            let efd = rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
            )?;
            doors.push(Arc::new(Door {
                queue: Mutex::new(Vec::new()),
                efd,
                conns: Arc::new(AtomicUsize::new(0)),
                cpu: std::sync::OnceLock::new(),
                local: Arc::new(AtomicUsize::new(0)),
            }));
        }
        reg.server.reactors.store(n, Ordering::Relaxed);
        let _ = reg
            .server
            .per_reactor
            .set(doors.iter().map(|d| d.conns.clone()).collect());
        let _ = reg
            .server
            .local
            .set(doors.iter().map(|d| d.local.clone()).collect());
        // every door exists before a reactor serves: a connection may move to any
        let place = Arc::new(Placement {
            wants: (0..n * n).map(|_| AtomicUsize::new(0)).collect(),
            doors,
            placing: Mutex::new(()),
        });
        for i in 0..n {
            let (place, reg) = (place.clone(), reg.clone());
            let pin = allowed.get(i).copied().filter(|_| pins);
            // the engine is made on the thread that uses its ring
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name(format!("nbd-reactor-{i}"))
                .spawn(move || {
                    if let Some(cpu) = pin {
                        match placement::pin(cpu) {
                            Ok(()) => {
                                let _ = place.doors[i].cpu.set(cpu);
                            }
                            Err(e) => tracing::warn!("nbd reactor {i}: not pinned to CPU {cpu}: {e}"),
                        }
                    }
                    match Shared::new(REACTOR_SLOTS, SLOTS_LIMIT) {
                        Ok(mut sh) => {
                            sh.engine.set_io_workers(IO_WORKERS);
                            let _ = tx.send(Ok(()));
                            run(sh, &place, i, &reg);
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                })?;
            rx.recv().map_err(std::io::Error::other)??;
        }
        let pinned: Vec<String> = place
            .doors
            .iter()
            .filter_map(|d| d.cpu.get())
            .map(|c| c.to_string())
            .collect();
        if pinned.is_empty() {
            tracing::info!("nbd: {n} reactors, not pinned ({} CPUs to run on)", allowed.len());
        } else {
            tracing::info!("nbd: {n} reactors on CPUs {}", pinned.join(","));
        }
        let deadlines = Arc::new(Deadlines::default());
        let d = deadlines.clone();
        std::thread::Builder::new()
            .name("nbd-deadlines".into())
            .spawn(move || enforce(&d))?;
        Ok(Arc::new(Reactors {
            place,
            handshakes: Mutex::new(0),
            handshake_done: Condvar::new(),
            deadlines,
        }))
    }

    /// Shut `sock` down if its handshake is not over within `within`.
    pub fn deadline(&self, sock: impl AsFd, within: std::time::Duration) -> Option<Deadline<'_>> {
        let fd = sock.as_fd().try_clone_to_owned().ok()?;
        let id = self.deadlines.next.fetch_add(1, Ordering::Relaxed);
        let at = std::time::Instant::now() + within;
        self.deadlines.list.lock().unpoisoned().push((id, at, fd));
        Some(Deadline {
            d: &self.deadlines,
            id,
        })
    }

    /// Hand a client in the transmission phase to a reactor with the fewest
    /// connections, the one on the client's CPU among them (a reactor's count
    /// falls when it closes a connection's socket, so a client that closes and
    /// connects again is counted once).
    pub fn hand(&self, c: NewConn) {
        let client = c.track.cpu_now(c.sock.as_fd());
        let p = &self.place;
        let to = {
            let _placing = p.placing.lock().unpoisoned();
            let Some(to) = placement::first(&p.loads(), &p.cpus(), client) else {
                return;
            };
            p.doors[to].conns.fetch_add(1, Ordering::Relaxed);
            to
        };
        p.hand_to(to, c);
    }

    /// Wait until another handshake may start.
    pub fn wait_for_room(&self) {
        let mut n = self.handshakes.lock().unpoisoned();
        while *n >= MAX_HANDSHAKES {
            n = self.handshake_done.wait(n).unpoisoned();
        }
    }

    /// A handshake starts.
    pub fn begin_handshake(&self, reg: &Registry) {
        let mut n = self.handshakes.lock().unpoisoned();
        *n += 1;
        reg.server.handshakes.store(*n, Ordering::Relaxed);
    }

    /// A handshake counted by [`Reactors::begin_handshake`] ended.
    pub fn end_handshake(&self, reg: &Registry) {
        let mut n = self.handshakes.lock().unpoisoned();
        *n -= 1;
        reg.server.handshakes.store(*n, Ordering::Relaxed);
        self.handshake_done.notify_one();
    }
}

/// The connections of one reactor, by id (the id is in their ring tags).
struct Conns {
    list: Vec<Option<Box<Conn>>>,
    free: Vec<u32>,
    /// Connections to step, each once (`queued`).
    ready: VecDeque<u32>,
    queued: Vec<bool>,
}

impl Conns {
    fn add(&mut self, make: impl FnOnce(u32) -> Conn) {
        let id = self.free.pop().unwrap_or_else(|| {
            self.list.push(None);
            self.queued.push(false);
            (self.list.len() - 1) as u32
        });
        self.list[id as usize] = Some(Box::new(make(id)));
        self.wake(id);
    }

    fn wake(&mut self, id: u32) {
        let i = id as usize;
        if i < self.queued.len() && !self.queued[i] && self.list[i].is_some() {
            self.queued[i] = true;
            self.ready.push_back(id);
        }
    }

    fn get(&mut self, id: u32) -> Option<&mut Conn> {
        self.list.get_mut(id as usize)?.as_deref_mut()
    }
}

/// One reactor's state: its engine and connections.
struct Reactor<'a> {
    sh: Shared,
    conns: Conns,
    events: Vec<IoEvent>,
    door: Option<&'a Door>,
    /// The reactors' placement, and which of them this is.
    place: Option<(&'a Placement, usize)>,
    next_check: std::time::Instant,
    door_armed: bool,
    door_rang: bool,
    /// What this reactor counts in the daemon's buffer bytes.
    buffers: usize,
    reg: &'a Arc<Registry>,
}

impl<'a> Reactor<'a> {
    fn new(sh: Shared, place: Option<(&'a Placement, usize)>, reg: &'a Arc<Registry>) -> Reactor<'a> {
        let door = place.map(|(p, i)| &*p.doors[i]);
        Reactor {
            place,
            next_check: std::time::Instant::now(),
            sh,
            conns: Conns {
                list: Vec::new(),
                free: Vec::new(),
                ready: VecDeque::new(),
                queued: Vec::new(),
            },
            events: Vec::with_capacity(64),
            door,
            door_armed: false,
            door_rang: door.is_some(),
            buffers: 0,
            reg,
        }
    }

    fn add(&mut self, c: NewConn) {
        if !c.moved {
            self.reg.server.connections.fetch_add(1, Ordering::Relaxed);
        }
        self.conns.add(|id| Conn::new(id, c));
    }

    /// Take new connections, step every connection that has something to do,
    /// and wait for the ring once.
    fn pass(&mut self) {
        if let Some(door) = self.door {
            if self.door_rang {
                self.door_rang = false;
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&door.efd, &mut buf);
                let new = std::mem::take(&mut *door.queue.lock().unpoisoned());
                for c in new {
                    self.add(c);
                }
            }
            if !self.door_armed {
                self.sh.engine.poll_in(door.efd.as_fd().as_raw_fd(), DOOR_TAG);
                self.door_armed = true;
            }
        }
        let (sh, conns) = (&mut self.sh, &mut self.conns);
        if !sh.starved.is_empty() && sh.engine.can_alloc() {
            for id in std::mem::take(&mut sh.starved) {
                if let Some(c) = conns.get(id) {
                    c.unstarve();
                }
                conns.wake(id);
            }
        }
        while let Some(r) = sh.engine.pop_done() {
            let id = sh.owner(r);
            if let Some(c) = conns.get(id) {
                c.finish(sh, r);
            }
            conns.wake(id);
        }
        let mut leaving: Vec<u32> = Vec::new();
        let mut moving: Vec<u32> = Vec::new();
        while let Some(id) = conns.ready.pop_front() {
            conns.queued[id as usize] = false;
            let Some(c) = conns.get(id) else { continue };
            c.step(sh);
            if c.detached() {
                moving.push(id);
                continue;
            }
            if c.is_dead() {
                c.drop_parked(sh);
            }
            if c.finished() {
                let was_open = !c.is_closed();
                if c.close(sh) {
                    leaving.push(id);
                }
                // placement's count falls as the socket closes, before the
                // client can see the close and connect again
                if let (true, Some(door)) = (was_open, self.door) {
                    door.conns.fetch_sub(1, Ordering::Relaxed);
                }
            }
            if !conns.ready.is_empty() {
                sh.engine.submit(); // this one's I/O starts while the next is parsed
            }
        }
        for id in leaving {
            self.release(id);
        }
        for id in moving {
            self.move_out(id);
        }
        self.check_placement();
        self.count_buffers();
        if self.door.is_none() && self.conns.list.iter().all(Option::is_none) {
            return; // serving one connection, which has gone: nothing more will come
        }
        self.wait();
    }

    /// Count what this reactor holds in the daemon's buffer bytes.
    fn count_buffers(&mut self) {
        let now = self.sh.buffer_bytes();
        if now != self.buffers {
            self.reg
                .server
                .buffer_bytes
                .fetch_add(now.wrapping_sub(self.buffers), Ordering::Relaxed);
            self.buffers = now;
        }
    }

    /// Wait for the ring once, and hand its events to the connections.
    fn wait(&mut self) {
        let (sh, conns) = (&mut self.sh, &mut self.conns);
        // a pinned reactor with connections wakes to look where their clients run
        let pinned = self.place.is_some_and(|(p, me)| p.doors[me].cpu.get().is_some());
        let wake = (pinned && conns.list.len() > conns.free.len()).then_some(placement::CHECK_EVERY);
        if let Err(e) = sh.engine.turn(wake) {
            tracing::error!("nbd reactor: its ring failed ({e}); its connections end");
            for id in 0..conns.list.len() as u32 {
                if let Some(c) = conns.get(id) {
                    c.fail();
                }
                conns.wake(id);
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        sh.engine.io_events(&mut self.events);
        for e in self.events.drain(..) {
            if self.door.is_some() && e.tag == DOOR_TAG {
                self.door_armed = e.more;
                self.door_rang = true;
                continue;
            }
            let (id, kind) = conn::untag(e.tag);
            if let Some(c) = conns.get(id) {
                c.on_event(sh, kind, &e);
                conns.wake(id);
            } else if kind != TAG_POLL {
                tracing::error!("nbd reactor: a completion for connection {id}, which is gone");
            }
        }
    }

    /// Hand a detached connection to the reactor it moves to.
    fn move_out(&mut self, id: u32) {
        let Some((place, me)) = self.place else { return };
        if !self.conns.get(id).is_some_and(|c| c.is_open()) {
            return self.release(id);
        }
        let Some(c) = self.conns.list[id as usize].take() else {
            return;
        };
        self.conns.free.push(id);
        let to = c.move_to.unwrap_or(me);
        if let Some(nc) = c.detach(&mut self.sh) {
            place.doors[me].conns.fetch_sub(1, Ordering::Relaxed);
            place.doors[to].conns.fetch_add(1, Ordering::Relaxed);
            self.reg.server.moved.fetch_add(1, Ordering::Relaxed);
            place.hand_to(to, nc);
        }
    }

    /// Every [`placement::CHECK_EVERY`]: look where the clients of the busy
    /// connections run, tell the other reactors, and ask the moves placement
    /// calls for (each done when its connection is next idle).
    fn check_placement(&mut self) {
        let Some((place, me)) = self.place else { return };
        let Some(&my_cpu) = place.doors[me].cpu.get() else {
            return; // not pinned: no CPU to be local to
        };
        let now = std::time::Instant::now();
        if now < self.next_check {
            return;
        }
        self.next_check = now + placement::CHECK_EVERY;
        let n = place.doors.len();
        let mut loads = place.loads();
        let mut wanting = vec![0usize; n];
        let mut local = 0;
        for c in self.conns.list.iter_mut().flatten() {
            let Some(cpu) = c.look() else { continue };
            if cpu == Some(my_cpu) {
                local += 1;
            }
            c.track.saw(place.reactor_on(cpu));
            let there = c
                .track
                .seen
                .filter(|&r| r != me && c.track.streak >= placement::STREAK);
            if c.move_to.is_some() && !c.is_moving() && c.move_to != there {
                c.move_to = None; // the client came back, or went elsewhere
            }
            match (c.move_to, there) {
                (Some(to), _) => {
                    // asked earlier, not yet idle: counted where it goes
                    loads[me] = loads[me].saturating_sub(1);
                    loads[to] += 1;
                }
                (None, Some(to)) => wanting[to] += 1,
                (None, None) => {}
            }
        }
        place.doors[me].local.store(local, Ordering::Relaxed);
        for (to, w) in wanting.iter().enumerate() {
            place.wants[me * n + to].store(*w, Ordering::Relaxed);
        }
        for c in self.conns.list.iter_mut().flatten() {
            if c.move_to.is_some() || c.track.streak < placement::STREAK {
                continue;
            }
            let Some(to) = c.track.seen.filter(|&r| r != me) else {
                continue;
            };
            if placement::move_to(me, to, &loads, place.wants(to, me) > 0) {
                c.move_to = Some(to);
                loads[me] = loads[me].saturating_sub(1);
                loads[to] += 1;
            }
        }
        if let Some(to) = placement::even_to(me, &loads) {
            // one connection whose client is not on this CPU, one whose client
            // is on that reactor's first
            let pick = |there: bool| {
                self.conns.list.iter().position(|c| {
                    c.as_ref().is_some_and(|c| {
                        c.move_to.is_none()
                            && c.is_open()
                            && if there {
                                c.track.seen == Some(to)
                            } else {
                                c.track.seen != Some(me)
                            }
                    })
                })
            };
            if let Some(c) = pick(true)
                .or_else(|| pick(false))
                .and_then(|i| self.conns.list[i].as_mut())
            {
                c.move_to = Some(to);
            }
        }
        for id in 0..self.conns.list.len() as u32 {
            if self
                .conns
                .get(id)
                .is_some_and(|c| c.move_to.is_some() && !c.is_moving())
            {
                self.conns.wake(id);
            }
        }
    }

    /// A closed connection leaves: its device is no longer open through it.
    fn release(&mut self, id: u32) {
        let Some(c) = self.conns.list[id as usize].take() else {
            return;
        };
        self.conns.free.push(id);
        self.reg.server.connections.fetch_sub(1, Ordering::Relaxed);
        let dev = c.dev.clone();
        // no longer open before the client sees its connection close, as a
        // close() of a block device returns once the device is released: a
        // client that waits for the close after NBD_CMD_DISC may remove it
        dev.open_count.fetch_sub(1, Ordering::SeqCst);
        drop(c);
        // free slots let go of the device, so that a removal is not kept waiting
        self.sh.engine.forget_devices();
        if dev.deferred_remove.load(Ordering::SeqCst) {
            // a deferred removal drains the device, whose I/O may be this thread's
            let reg = self.reg.clone();
            let _ = std::thread::Builder::new()
                .name("nbd-closed".into())
                .spawn(move || reg.closed(&dev));
        }
    }
}

fn run(sh: Shared, place: &Placement, me: usize, reg: &Arc<Registry>) {
    let mut r = Reactor::new(sh, Some((place, me)), reg);
    loop {
        r.pass();
    }
}

/// Serve one connection on this thread until it ends, with an engine of its
/// own (the fuzzers' way in: the connection's whole life in one call). Every
/// operation it started has completed when this returns.
pub fn serve_alone(c: NewConn, reg: &Arc<Registry>) -> std::io::Result<()> {
    let mut r = Reactor::new(Shared::new(256, 256)?, None, reg);
    r.add(c);
    while r.conns.list.iter().any(Option::is_some) {
        r.pass();
    }
    r.sh.engine.shut_down();
    Ok(())
}
