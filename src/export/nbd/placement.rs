//! Which reactor serves a connection: the one on its client's CPU, with the
//! reactors' loads kept even.
//!
//! Measured (BENCHMARKS.md, `repeat`): four fio jobs at QD1 with a flush after
//! each write ran at 130 K IOPS when each job shared a CPU with the reactor
//! serving it and at 64 K when half of them sat on the other CPU, every
//! connection placed 2 and 2 both times. A request then crosses CPUs twice
//! (the client's send wakes the reactor, the reply wakes the client), and the
//! wake-ups, not the work, cost the difference (server CPU 9.5 against 17 µs a
//! request). Which of the two a run got was the scheduler's choice, kept for
//! the whole run.
//!
//! So each reactor is pinned to a CPU of its own (while there are no more
//! reactors than CPUs the daemon may use), a new connection goes to a least
//! loaded reactor, the one on its client's CPU among them, and every
//! [`CHECK_EVERY`] a reactor looks where the clients of its busy connections
//! run: a connection whose client has run on another reactor's CPU at
//! [`STREAK`] checks in a row moves there when that reactor serves fewer
//! connections, or as many and wants to send one back (a swap). Loads apart by
//! two or more are evened by moving a connection whatever its client. A
//! connection moves only when idle (nothing received and unanswered, nothing
//! buffered), from one request to the next.
//!
//! Where a client runs: for TCP, the CPU that received its last segment
//! (`SO_INCOMING_CPU`; on loopback the sender's); for a unix socket, the CPU
//! the peer process last ran on when it has one thread and used CPU since the
//! last check (a process of several threads does not say which of them is the
//! client, and one that used no CPU, such as `nbd-client` handing its socket to
//! the kernel, is not where the requests come from). Otherwise a connection has
//! no CPU and is placed by load alone.

use rustix::net::AddressFamily;
use std::os::fd::BorrowedFd;
use std::time::Duration;

/// How often a reactor looks where its clients run.
pub const CHECK_EVERY: Duration = Duration::from_millis(100);
/// Checks in a row that must see a client on another reactor's CPU before its
/// connection moves (a client the scheduler moves back and forth stays put).
pub const STREAK: u8 = 2;

/// Who is at the other end of a connection, as far as placement cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    Tcp,
    Process(i32),
    Unknown,
}

/// What a reactor knows of one connection's client between checks.
#[derive(Clone, Copy, Debug)]
pub struct Track {
    pub peer: Peer,
    /// The client process's CPU time at the last check (clock ticks).
    ticks: u64,
    /// Requests the connection had taken at the last check.
    served: u64,
    /// The reactor on whose CPU the client was last seen, and how many checks
    /// in a row saw it there.
    pub seen: Option<usize>,
    pub streak: u8,
}

impl Track {
    pub fn new(sock: BorrowedFd) -> Track {
        Track {
            peer: peer_of(sock),
            ticks: 0,
            served: 0,
            seen: None,
            streak: 0,
        }
    }

    /// Look again where the client runs, for a connection that has taken
    /// `served` requests in all: the CPU, or None for a connection that took
    /// no request since the last look or whose client cannot be placed.
    pub fn look(&mut self, sock: BorrowedFd, served: u64) -> Option<usize> {
        if served == self.served {
            return None; // idle: where its client runs does not matter
        }
        self.served = served;
        let (cpu, ticks) = self.sample(sock);
        if let Some(ticks) = ticks {
            // a process that used no CPU since the last look is not the client
            let ran = ticks != self.ticks;
            self.ticks = ticks;
            return cpu.filter(|_| ran);
        }
        cpu
    }

    /// Count one check that saw the client on `reactor`'s CPU (None: nowhere
    /// known).
    pub fn saw(&mut self, reactor: Option<usize>) {
        if reactor.is_some() && reactor == self.seen {
            self.streak = self.streak.saturating_add(1);
        } else {
            self.seen = reactor;
            self.streak = u8::from(reactor.is_some());
        }
    }

    /// The CPU the client is on now, for a new connection (no history).
    pub fn cpu_now(&self, sock: BorrowedFd) -> Option<usize> {
        self.sample(sock).0
    }

    /// Where the client last ran, and a process client's CPU time in clock
    /// ticks.
    fn sample(&self, sock: BorrowedFd) -> (Option<usize>, Option<u64>) {
        match self.peer {
            Peer::Tcp => (
                rustix::net::sockopt::socket_incoming_cpu(sock)
                    .ok()
                    .map(|c| c as usize),
                None,
            ),
            Peer::Process(pid) => match process_cpu(pid) {
                Some((cpu, ticks)) => (cpu, Some(ticks)),
                None => (None, None),
            },
            Peer::Unknown => (None, None),
        }
    }
}

fn peer_of(sock: BorrowedFd) -> Peer {
    match rustix::net::sockopt::socket_domain(sock) {
        Ok(AddressFamily::INET | AddressFamily::INET6) => Peer::Tcp,
        Ok(AddressFamily::UNIX) => match peer_pid(sock) {
            Some(pid) if pid != std::process::id() as i32 => Peer::Process(pid),
            _ => Peer::Unknown,
        },
        _ => Peer::Unknown,
    }
}

/// The pid of a unix socket's peer (`SO_PEERCRED`): None when the kernel
/// gives none (0: a peer in a pid namespace this one cannot see). Read by hand:
/// rustix's `UCred` holds the pid as a non-zero type, which a 0 would break.
fn peer_pid(sock: BorrowedFd) -> Option<i32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a ucred of
    // that size owned here, on a descriptor borrowed for the call.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0 && len as usize == std::mem::size_of::<libc::ucred>() && cred.pid > 0).then_some(cred.pid)
}

/// A process's CPU (None when it has more than one thread) and its CPU time in
/// clock ticks, from `/proc/PID/stat`; None when it is gone.
fn process_cpu(pid: i32) -> Option<(Option<usize>, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the fields after the command, which is in parentheses and may hold any byte
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_ascii_whitespace().take(37).collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    // fields 14, 15, 20 and 39 of proc(5): utime, stime, num_threads, processor
    let ticks = num(11)? + num(12)?;
    let cpu = (num(17)? == 1).then(|| num(36)).flatten().map(|c| c as usize);
    Some((cpu, ticks))
}

/// Where reactor `me` should send a connection whose client runs on reactor
/// `to`'s CPU, given every reactor's load and whether `to` has a connection
/// whose client runs on `me`'s CPU (`swap`).
pub fn move_to(me: usize, to: usize, loads: &[usize], swap: bool) -> bool {
    to != me && (loads[to] < loads[me] || (loads[to] == loads[me] && swap))
}

/// The reactor to even loads with, when `me` serves two or more connections
/// more than it.
pub fn even_to(me: usize, loads: &[usize]) -> Option<usize> {
    let (least, &min) = loads.iter().enumerate().min_by_key(|&(_, l)| *l)?;
    (loads[me] >= min + 2).then_some(least)
}

/// The reactor for a new connection: a least loaded one, the one on the
/// client's CPU among them if any.
pub fn first(loads: &[usize], cpus: &[Option<usize>], client: Option<usize>) -> Option<usize> {
    let min = *loads.iter().min()?;
    let least = |i: &usize| loads[*i] == min;
    (0..loads.len())
        .filter(least)
        .find(|&i| client.is_some() && cpus[i] == client)
        .or_else(|| (0..loads.len()).find(least))
}

/// The CPUs this thread may run on, in order.
pub fn allowed_cpus() -> Vec<usize> {
    match rustix::thread::sched_getaffinity(None) {
        Ok(set) => (0..rustix::thread::CpuSet::MAX_CPU)
            .filter(|&c| set.is_set(c))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Pin the calling thread to `cpu`.
pub fn pin(cpu: usize) -> std::io::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_connection_goes_to_a_least_loaded_reactor_its_clients_if_it_can() {
        let cpus = [Some(0), Some(1)];
        assert_eq!(first(&[0, 0], &cpus, Some(1)), Some(1));
        assert_eq!(first(&[0, 0], &cpus, None), Some(0));
        // balance first: the client's reactor serves more
        assert_eq!(first(&[1, 0], &cpus, Some(0)), Some(1));
        assert_eq!(first(&[1, 1], &cpus, Some(0)), Some(0));
        assert_eq!(first(&[], &[], Some(0)), None);
        // fio's four jobs, two on each CPU, connecting in turn: 2 and 2, each
        // on its client's CPU
        for order in [[0, 1, 0, 1], [1, 0, 0, 1], [1, 0, 1, 0]] {
            let mut loads = [0, 0];
            for client in order {
                let r = first(&loads, &cpus, Some(client)).expect("a reactor");
                assert_eq!(cpus[r], Some(client), "order {order:?}");
                loads[r] += 1;
            }
        }
        // the two of one CPU first: balance puts one of them on the other
        // reactor, and one of the other CPU's on theirs: a swap mends both
        let mut loads = [0, 0];
        let placed: Vec<usize> = [0, 0, 1, 1]
            .iter()
            .map(|&client| {
                let r = first(&loads, &cpus, Some(client)).expect("a reactor");
                loads[r] += 1;
                r
            })
            .collect();
        assert_eq!(placed, [0, 1, 1, 0]);
        assert!(move_to(0, 1, &loads, true) && move_to(1, 0, &loads, true));
    }

    #[test]
    fn moves_keep_loads_even_and_swaps_take_both_sides() {
        assert!(move_to(0, 1, &[3, 2], false));
        assert!(!move_to(0, 1, &[2, 2], false));
        assert!(move_to(0, 1, &[2, 2], true));
        assert!(!move_to(0, 1, &[2, 3], true));
        assert!(!move_to(1, 1, &[0, 3], true));
        assert_eq!(even_to(1, &[0, 2]), Some(0));
        assert_eq!(even_to(1, &[1, 2]), None);
        assert_eq!(even_to(0, &[1, 2]), None);
        assert_eq!(even_to(2, &[3, 1, 5]), Some(1));
    }

    #[test]
    fn a_client_must_be_seen_twice_in_a_row_on_the_same_reactor() {
        let mut t = Track {
            peer: Peer::Unknown,
            ticks: 0,
            served: 0,
            seen: None,
            streak: 0,
        };
        t.saw(Some(1));
        assert_eq!((t.seen, t.streak), (Some(1), 1));
        t.saw(Some(1));
        assert!(t.streak >= STREAK);
        t.saw(Some(0));
        assert_eq!((t.seen, t.streak), (Some(0), 1));
        t.saw(None);
        assert_eq!((t.seen, t.streak), (None, 0));
    }

    #[test]
    fn peers_are_told_apart_by_their_socket() {
        use std::os::fd::AsFd;
        let (a, _b) = std::os::unix::net::UnixStream::pair().expect("a socket pair");
        assert_eq!(peer_pid(a.as_fd()), Some(std::process::id() as i32));
        // this process's own sockets place nothing
        assert_eq!(peer_of(a.as_fd()), Peer::Unknown);
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let c = std::net::TcpStream::connect(l.local_addr().expect("address")).expect("connect");
        assert_eq!(peer_of(c.as_fd()), Peer::Tcp);
    }

    #[test]
    fn this_process_is_read_from_proc() {
        let (cpu, _) = process_cpu(std::process::id() as i32).expect("our own stat");
        // the test harness runs threads: no single CPU to name
        assert_eq!(cpu, None);
        assert!(process_cpu(i32::MAX).is_none());
    }
}
