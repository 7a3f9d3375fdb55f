//! Where the daemon's NBD reactors serve connections (`export::nbd::placement`):
//! what `dmkit stats --server` says of it, and fio's jobs moved between CPUs.

use super::{need, Daemon};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A `key=a,b,...` list of `dmkit stats --server`.
pub fn server_list(d: &Daemon, key: &str) -> Vec<u64> {
    let line = d.ok(&["stats", "--server"]);
    let v = line
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"));
    v.split(',').map(|n| n.parse().expect("a count")).collect()
}

/// Wait until `dmkit stats --server` shows `connections` and no handshake.
pub fn wait_connections(d: &Daemon, connections: u64) {
    let t0 = Instant::now();
    loop {
        let (n, h) = (server_list(d, "connections"), server_list(d, "handshakes"));
        if n == [connections] && h == [0] {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the server never reached {connections} connections: {}",
            d.ok(&["stats", "--server"])
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `per_reactor`: the connections each reactor serves.
pub fn per_reactor(d: &Daemon) -> Vec<u64> {
    server_list(d, "per_reactor")
}

/// The CPUs this process may run on, in order: the daemon's reactors are
/// pinned to the first of them.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity fills the cpu_set_t it is given.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        set
    };
    // SAFETY: CPU_ISSET reads the set for a CPU number below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// The first two CPUs this process may run on; a test of placement needs them.
pub fn two_cpus() -> (usize, usize) {
    let cpus = allowed_cpus();
    assert!(
        cpus.len() >= 2,
        "this test needs two CPUs; it may run on {cpus:?}"
    );
    (cpus[0], cpus[1])
}

/// Let process `pid` run on `cpu` only (as the scheduler might move it there).
pub fn pin(pid: u32, cpu: usize) {
    // SAFETY: a zeroed cpu_set_t with one CPU set, passed by reference.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(pid as i32, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(r, 0, "pinning process {pid} to CPU {cpu}");
}

/// Wait until `ok` holds, for at most 20 s.
pub fn wait_server(d: &Daemon, what: &str, ok: impl Fn(&Daemon) -> bool) {
    let t0 = Instant::now();
    while !ok(d) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what}: never reached; {}",
            d.ok(&["stats", "--server"])
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The processes whose parent is `parent`.
fn children(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|st| {
                    st.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse::<u32>()
                        .ok()
                })
                == Some(parent)
        })
        .collect()
}

/// fio's nbd engine on `uri` (a device of at least 64 MiB on a daemon with two
/// reactors), 4 jobs at QD1, each writing its own 16 MiB with a flush after
/// every write and reading back every 64 writes to verify them; `home`, when
/// given, is fio's $HOME (libnbd reads TLS credentials from
/// `$HOME/.pki/libnbd`). The jobs are pinned two to each CPU, then swapped:
/// each time every connection must end on its client's reactor, 2 and 2, and
/// the swap must move all four; fio must then end with no error in any job.
pub fn fio_jobs_follow_their_cpus(d: &Daemon, uri: &str, home: Option<&Path>) {
    need("fio");
    let (c0, c1) = two_cpus();
    let mut cmd = Command::new("fio");
    cmd.args(["--name=place", "--ioengine=nbd", &format!("--uri={uri}")])
        .args([
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=1",
            "--fsync=1",
            "--numjobs=4",
        ])
        .args([
            "--size=16M",
            "--offset_increment=16M",
            "--verify=crc32c",
            "--verify_backlog=64",
        ])
        .args(["--verify_fatal=1", "--time_based", "--runtime=120"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(h) = home {
        cmd.env("HOME", h);
    }
    let fio = cmd.spawn().expect("fio");
    wait_connections(d, 4);
    let jobs = children(fio.id());
    assert_eq!(jobs.len(), 4, "fio's job processes: {jobs:?}");
    let all_local = |d: &Daemon| per_reactor(d) == [2, 2] && server_list(d, "local") == [2, 2];
    for (i, &j) in jobs.iter().enumerate() {
        pin(j, if i < 2 { c0 } else { c1 });
    }
    wait_server(d, "two jobs on each CPU, each served there", all_local);
    let moved = server_list(d, "moved")[0];
    println!("jobs {jobs:?} on CPUs {c0},{c0},{c1},{c1}: served there, {moved} moves");
    // the scheduler swaps them: every connection is now on the other CPU's reactor
    for (i, &j) in jobs.iter().enumerate() {
        pin(j, if i < 2 { c1 } else { c0 });
    }
    wait_server(d, "the jobs swapped CPUs, their connections followed", |d| {
        all_local(d) && server_list(d, "moved")[0] >= moved + 4
    });
    println!("swapped: followed, {} moves", server_list(d, "moved")[0]);
    // fio's own end: its jobs stop, each says whether it saw an error
    // SAFETY: a signal to a process this test started.
    assert_eq!(unsafe { libc::kill(fio.id() as i32, libc::SIGTERM) }, 0);
    let out = fio.wait_with_output().expect("fio's output");
    let text = String::from_utf8_lossy(&out.stdout);
    let clean = text.lines().filter(|l| l.contains("err= 0")).count();
    assert_eq!(
        clean,
        4,
        "fio's four jobs should end without error: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_connections(d, 0);
    assert_eq!(per_reactor(d), [0, 0]);
}
