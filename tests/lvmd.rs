//! `dmkit lvmd` (issue 49): TopoLVM's lvmd protocol and CSI's SnapshotMetadata
//! served from a dmkit thin pool, driven by a client that grpcio-tools generates
//! from proto/ (tests/lvmd/client.py), with data written and read over NBD and
//! deltas checked against the thin-provisioning-tools 1.x reference thin_delta.

use crate::common;
use crate::thin_util;
use common::nbd::{self, Client as Nbd};
use common::Daemon;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::MIB;
const BIN: &str = env!("CARGO_BIN_EXE_dmkit");
/// The pool's block: 128 sectors.
const BLOCK: u64 = 64 * 1024;
/// The pool's data device.
const POOL_BYTES: u64 = 1024 * MIB;

/// A thin pool `pool` (64 KiB blocks, 1 GiB) and lvmd's configuration for it.
fn pool(d: &Daemon, ratio: &str) -> PathBuf {
    let meta = d.dir.sparse("meta.img", 64 * MIB);
    let data = d.dir.sparse("data.img", POOL_BYTES);
    d.create(
        "pool",
        &format!(
            "0 {} thin-pool {} {} 128 0",
            POOL_BYTES / 512,
            meta.display(),
            data.display()
        ),
    );
    let cfg = d.dir.path("lvmd.yaml");
    std::fs::write(
        &cfg,
        format!(
            "socket-name: {}\ndevice-classes:\n  - name: thin\n    default: true\n    spare-gb: 1\n    type: thin\n    thin-pool:\n      name: pool\n      overprovision-ratio: {ratio}\n",
            d.dir.path("lvmd.sock").display()
        ),
    )
    .unwrap();
    cfg
}

/// tests/lvmd/client.py on a socket: one gRPC channel for every call.
pub(crate) struct Client {
    proc: Child,
    tx: ChildStdin,
    rx: BufReader<ChildStdout>,
}

impl Client {
    /// The client on lvmd's socket (and SnapshotMetadata's, if given).
    pub(crate) fn spawn(sock: &Path, sm: Option<&Path>) -> Client {
        let mut proc = Command::new("python3")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/lvmd/client.py"))
            .arg(sock)
            .args(sm)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 tests/lvmd/client.py (ci/install.sh installs grpcio-tools)");
        let tx = proc.stdin.take().unwrap();
        let rx = BufReader::new(proc.stdout.take().unwrap());
        Client { proc, tx, rx }
    }

    /// Send one request without waiting for its answer ([`Client::answer`]).
    pub(crate) fn send(&mut self, q: &Value) {
        writeln!(self.tx, "{q}").unwrap();
        self.tx.flush().unwrap();
    }

    /// The answer to the oldest request sent.
    pub(crate) fn answer(&mut self) -> Result<Value, (String, String)> {
        let mut line = String::new();
        self.rx.read_line(&mut line).unwrap();
        let a: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("client answered '{line}': {e}"));
        match a.get("ok") {
            Some(v) => Ok(v.clone()),
            None => Err((
                a["code"].as_str().unwrap().to_string(),
                a["details"].as_str().unwrap_or("").to_string(),
            )),
        }
    }

    /// One call: Ok(the answer) or Err((gRPC code, details)).
    pub(crate) fn call(&mut self, svc: &str, rpc: &str, req: Value) -> Result<Value, (String, String)> {
        self.ask(json!({"svc": svc, "rpc": rpc, "req": req}))
    }

    fn ask(&mut self, q: Value) -> Result<Value, (String, String)> {
        self.send(&q);
        self.answer()
    }

    pub(crate) fn ok(&mut self, svc: &str, rpc: &str, req: Value) -> Value {
        self.call(svc, rpc, req.clone())
            .unwrap_or_else(|e| panic!("{rpc} {req}: {e:?}"))
    }

    pub(crate) fn fails(&mut self, svc: &str, rpc: &str, req: Value, code: &str) -> String {
        match self.call(svc, rpc, req.clone()) {
            Ok(v) => panic!("{rpc} {req} answered {v} (expected {code})"),
            Err((c, m)) => {
                assert_eq!(c, code, "{rpc} {req}: {m}");
                m
            }
        }
    }

    /// The volumes GetLVList names, by name.
    pub(crate) fn names(&mut self) -> BTreeSet<String> {
        let l = self.ok("vg", "GetLVList", json!({"device_class": "thin"}));
        l["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap().to_string())
            .collect()
    }
}

impl Client {
    /// The client gone (its connection closed).
    fn stop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A running `dmkit lvmd` and a client connected to it.
struct Lvmd {
    child: Child,
    client: Client,
}

impl std::ops::Deref for Lvmd {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl std::ops::DerefMut for Lvmd {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

impl Lvmd {
    fn start(d: &Daemon, cfg: &Path, extra: &[&str]) -> Lvmd {
        let sock = d.dir.path("lvmd.sock");
        let sm = d.dir.path("sm.sock");
        let _ = std::fs::remove_file(d.dir.path("lvmd.started"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.dir.path("lvmd.log"))
            .unwrap();
        let child = Command::new(BIN)
            .args(["lvmd", "--run-dir"])
            .arg(&d.run)
            .arg("--config")
            .arg(cfg)
            .args(["--no-attach", "--snapshot-metadata"])
            .arg(format!("unix:{}", sm.display()))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn dmkit lvmd");
        let t0 = Instant::now();
        while !(sock.exists() && sm.exists() && std::os::unix::net::UnixStream::connect(&sm).is_ok()) {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "lvmd did not start: {}",
                log_of(d)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Lvmd {
            child,
            client: Client::spawn(&sock, Some(&sm)),
        }
    }

    /// Wait for the process (after it exited on its own).
    fn wait_exit(mut self) -> i32 {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                self.client.stop();
                return s.code().unwrap_or(-1);
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "lvmd did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Lvmd {
    fn drop(&mut self) {
        self.client.stop();
        // SIGTERM: a clean stop
        // SAFETY: the pid is our child's, not yet reaped
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn log_of(d: &Daemon) -> String {
    std::fs::read_to_string(d.dir.path("lvmd.log")).unwrap_or_default()
}

fn int(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_i64().map(|i| i as u64))
        .unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The devices `dmkit ls` lists.
fn devices(d: &Daemon) -> BTreeSet<String> {
    d.ok(&["ls"])
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|n| n != "No")
        .collect()
}

/// The thin device ids the pool holds.
fn thin_ids(d: &Daemon) -> BTreeSet<u64> {
    d.ok(&["message", "pool", "0", "thin_ls -o DEV --no-headers"])
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect()
}

fn table_bytes(d: &Daemon, name: &str) -> u64 {
    let t = d.ok(&["table", name]);
    let w: Vec<&str> = t.split_whitespace().collect();
    w[1].parse::<u64>().unwrap() * 512
}

#[test]
fn lvmd_serves_topolvms_protocol_from_a_thin_pool() {
    let d = Daemon::start("lvmd-proto");
    let cfg = pool(&d, "10.0");
    let mut l = Lvmd::start(&d, &cfg, &[]);

    // free: 10 x the pool, less the 1 GiB spare (GetFreeBytes), as lvmd computes it
    let free = int(&l.ok("vg", "GetFreeBytes", json!({"device_class": ""}))["free_bytes"]);
    assert_eq!(free, 10 * POOL_BYTES - (1 << 30));

    // a size rounds up to LVM's 4 MiB extent; tags kept; path and numbers the device's
    let v = l.ok(
        "lv",
        "CreateLV",
        json!({"name": "vol", "size_bytes": 100 * MIB + 1, "tags": ["a", "b"], "device_class": "thin"}),
    )["volume"]
        .clone();
    assert_eq!(int(&v["size_bytes"]), 104 * MIB);
    assert_eq!(v["name"], "vol");
    let info = d.ok(&[
        "info",
        "-c",
        "--noheadings",
        "-o",
        "major,minor",
        "--separator",
        ":",
        "vol",
    ]);
    assert_eq!(format!("{}:{}", v["dev_major"], v["dev_minor"]), info.trim());
    assert_eq!(table_bytes(&d, "vol"), 104 * MIB);
    let list = l.ok("vg", "GetLVList", json!({"device_class": "thin"}));
    let listed = &list["volumes"][0];
    assert_eq!(listed["tags"], json!(["a", "b"]));
    assert_eq!(listed["path"], "/dev/mapper/vol");
    assert_eq!(listed["attr"], "Vwi-a-tz--");

    // data written over NBD; a read-only snapshot holds it, the volume moves on
    let first = common::pattern(1, 4 * MIB as usize);
    let mut n = Nbd::connect(&d.sock(), "vol");
    n.write(0, &first);
    let s = l.ok(
        "lv",
        "CreateLVSnapshot",
        json!({"name": "snap", "source_volume": "vol", "access_type": "ro", "device_class": "thin"}),
    )["snapshot"]
        .clone();
    assert_eq!(int(&s["size_bytes"]), 104 * MIB);
    n.write(0, &common::pattern(2, MIB as usize));
    drop(n);
    assert_eq!(Nbd::connect(&d.sock(), "snap").read(0, first.len()), first);
    let ro = d.ok(&["info", "snap"]);
    assert!(ro.contains("(READ-ONLY)"), "snapshot not read-only: {ro}");

    // grow: exact size back; a smaller size keeps the volume as it is
    let r = l.ok(
        "lv",
        "ResizeLV",
        json!({"name": "vol", "size_bytes": 200 * MIB, "device_class": "thin"}),
    );
    assert_eq!(int(&r["size_bytes"]), 200 * MIB);
    assert_eq!(table_bytes(&d, "vol"), 200 * MIB);
    let r = l.ok(
        "lv",
        "ResizeLV",
        json!({"name": "vol", "size_bytes": 8 * MIB, "device_class": "thin"}),
    );
    assert_eq!(int(&r["size_bytes"]), 200 * MIB);

    // Watch: the pool's use as it changes, under writes and when the pool grows
    let w = l
        .ask(json!({"svc": "vg", "rpc": "Watch", "req": {}, "take": 1}))
        .unwrap();
    let first_watch = w[0].clone();
    let item = &first_watch["items"][0];
    assert_eq!(item["device_class"], "thin");
    assert_eq!(int(&item["thin_pool"]["size_bytes"]), POOL_BYTES);
    assert_eq!(
        int(&first_watch["free_bytes"]),
        10 * POOL_BYTES - 304 * MIB,
        "overprovisioned free: 10 GiB less the two volumes"
    );
    let used_before = item["thin_pool"]["data_percent"].as_f64().unwrap();
    let run = d.run.clone();
    let sock = d.sock();
    let grown = 2 * POOL_BYTES;
    let data = d.dir.path("data.img");
    let meta = d.dir.path("meta.img");
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        let mut n = Nbd::connect(&sock, "vol");
        n.write(64 * MIB, &common::pattern(3, 32 * MIB as usize));
        n.call(nbd::FLUSH, 0, 0, 0, &[]);
        std::thread::sleep(Duration::from_millis(1500));
        std::fs::File::options()
            .write(true)
            .open(&data)
            .unwrap()
            .set_len(grown)
            .unwrap();
        let table = format!(
            "0 {} thin-pool {} {} 128 0",
            grown / 512,
            meta.display(),
            data.display()
        );
        for args in [vec!["load", "pool", "--table", &table], vec!["resume", "pool"]] {
            let o = Command::new(BIN)
                .arg("--run-dir")
                .arg(&run)
                .args(&args)
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
    });
    let msgs = l
        .ask(json!({"svc": "vg", "rpc": "Watch", "req": {}, "until_pool_size": grown, "timeout": 30}))
        .unwrap();
    writer.join().unwrap();
    let msgs = msgs.as_array().unwrap();
    assert!(
        msgs.len() >= 3,
        "initial, after the writes, after the growth: {msgs:?}"
    );
    let last = &msgs[msgs.len() - 1]["items"][0]["thin_pool"];
    assert_eq!(int(&last["size_bytes"]), grown);
    let after_writes = msgs[..msgs.len() - 1]
        .iter()
        .map(|m| m["items"][0]["thin_pool"]["data_percent"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(
        after_writes >= used_before + 3.0,
        "32 MiB of 1 GiB written: data_percent {used_before} -> {after_writes}"
    );
    assert_eq!(int(&msgs[msgs.len() - 1]["free_bytes"]), 10 * grown - 304 * MIB);

    // Watch streams are bounded: the 65th is refused, the others go on
    let codes = l.ask(json!({"hold_watches": 65})).unwrap();
    let codes: Vec<&str> = codes
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(codes[..64], ["OK"; 64]);
    assert_eq!(codes[64], "RESOURCE_EXHAUSTED");
    l.ask(json!({"hold_watches": 0})).unwrap();

    // bad requests: the codes TopoLVM expects, and lvmd goes on serving
    l.fails(
        "lv",
        "CreateLV",
        json!({"name": "x", "size_bytes": MIB, "device_class": "nope"}),
        "NOT_FOUND",
    );
    l.fails(
        "lv",
        "CreateLV",
        json!({"name": "vol", "size_bytes": MIB}),
        "ALREADY_EXISTS",
    );
    l.fails(
        "lv",
        "CreateLV",
        json!({"name": "x", "size_bytes": -1}),
        "INVALID_ARGUMENT",
    );
    l.fails(
        "lv",
        "CreateLV",
        json!({"name": "-x", "size_bytes": MIB}),
        "INVALID_ARGUMENT",
    );
    l.fails(
        "lv",
        "CreateLV",
        json!({"name": "a/b", "size_bytes": MIB}),
        "INVALID_ARGUMENT",
    );
    let m = l.fails(
        "lv",
        "CreateLV",
        json!({"name": "huge", "size_bytes": 100 * POOL_BYTES}),
        "RESOURCE_EXHAUSTED",
    );
    assert!(m.contains("no enough space"), "{m}");
    l.fails(
        "lv",
        "RemoveLV",
        json!({"name": "ghost", "device_class": "thin"}),
        "NOT_FOUND",
    );
    l.fails(
        "lv",
        "ResizeLV",
        json!({"name": "ghost", "size_bytes": MIB}),
        "NOT_FOUND",
    );
    l.fails(
        "lv",
        "CreateLVSnapshot",
        json!({"name": "s", "source_volume": "ghost"}),
        "NOT_FOUND",
    );
    l.fails(
        "lv",
        "CreateLVSnapshot",
        json!({"name": "s", "source_volume": "vol", "access_type": "rx"}),
        "INVALID_ARGUMENT",
    );
    l.fails(
        "lv",
        "CreateLVSnapshot",
        json!({"name": "s", "source_volume": "vol", "size_bytes": MIB}),
        "OUT_OF_RANGE",
    );
    let huge_name = "n".repeat(100_000);
    let m = l.fails(
        "lv",
        "CreateLV",
        json!({"name": huge_name, "size_bytes": MIB}),
        "INVALID_ARGUMENT",
    );
    assert!(
        m.len() < 400,
        "the error quotes the name bounded: {} bytes",
        m.len()
    );

    // an open volume is not removed; a closed one goes with its thin device
    let held = Nbd::connect(&d.sock(), "snap");
    let m = l.fails(
        "lv",
        "RemoveLV",
        json!({"name": "snap", "device_class": "thin"}),
        "INTERNAL",
    );
    assert!(m.contains("in use"), "{m}");
    drop(held);
    d.wait_open_count("snap", 0);
    let ids = thin_ids(&d).len();
    l.ok("lv", "RemoveLV", json!({"name": "snap", "device_class": "thin"}));
    assert_eq!(thin_ids(&d).len(), ids - 1);
    assert_eq!(l.names(), BTreeSet::from(["vol".to_string()]));
    assert!(!devices(&d).contains("snap"));

    // a dmkit device lvmd did not make is neither taken over nor removed
    d.create("taken", "0 8 zero");
    let m = l.fails(
        "lv",
        "CreateLV",
        json!({"name": "taken", "size_bytes": MIB}),
        "ALREADY_EXISTS",
    );
    assert!(m.contains("not one of lvmd's volumes"), "{m}");
    assert!(devices(&d).contains("taken"));
    d.ok(&["remove", "taken"]);

    // the records outlive lvmd: a new one lists the same volume
    drop(l);
    let mut l = Lvmd::start(&d, &cfg, &[]);
    assert_eq!(l.names(), BTreeSet::from(["vol".to_string()]));
    drop(l);

    // configurations lvmd cannot serve are refused at start, saying why
    for (yaml, says) in [
        (
            "device-classes:\n  - name: ssd\n    volume-group: vg\n    default: true\n",
            "type thick is not supported",
        ),
        (
            "device-classes:\n  - name: t\n    type: thin\n    thin-pool: {name: vol}\n",
            "vol is a thin device, not a thin-pool",
        ),
        (
            "device-classes:\n  - name: t\n    type: thin\n    thin-pool: {name: nopool}\n",
            "thin pool nopool",
        ),
    ] {
        let bad = d.dir.path("bad.yaml");
        std::fs::write(&bad, yaml).unwrap();
        let o = Command::new(BIN)
            .args(["lvmd", "--no-attach", "--run-dir"])
            .arg(&d.run)
            .arg("--config")
            .arg(&bad)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(says), "{yaml}: {err}");
    }
    // without --no-attach each volume is to be a ublk device: on a host without
    // ublk lvmd says so at start (tests/lvmd_guest.rs runs it with ublk)
    if !Path::new("/dev/ublk-control").exists() {
        let o = Command::new(BIN)
            .args(["lvmd", "--run-dir"])
            .arg(&d.run)
            .arg("--config")
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success()
                && err.contains("ublk is not available: /dev/ublk-control does not exist")
                && err.contains("--no-attach"),
            "{err}"
        );
    }
}

/// What lvmd's records, the pool and the daemon's devices must agree on after
/// any stop: every listed volume has its device and thin device, nothing else.
fn consistent(d: &Daemon, l: &mut Lvmd) -> BTreeSet<String> {
    let names = l.names();
    let mut want: BTreeSet<String> = names.clone();
    want.insert("pool".into());
    assert_eq!(devices(d), want, "devices vs GetLVList");
    assert_eq!(thin_ids(d).len(), names.len(), "thin devices vs GetLVList");
    for n in &names {
        // none left suspended (a snapshot suspends its origin)
        let state = d.info_line(n, "State");
        assert!(
            state.contains("ACTIVE") && !state.contains("SUSPENDED"),
            "{n}: {state}"
        );
    }
    names
}

#[test]
fn a_lvmd_stopped_between_any_two_steps_leaves_no_half_volume() {
    let d = Daemon::start("lvmd-steps");
    let cfg = pool(&d, "10.0");
    let mut l = Lvmd::start(&d, &cfg, &[]);
    l.ok("lv", "CreateLV", json!({"name": "base", "size_bytes": 64 * MIB}));
    Nbd::connect(&d.sock(), "base").write(0, &common::pattern(7, MIB as usize));
    drop(l);
    let base: BTreeSet<String> = ["base".to_string()].into();
    let with = |n: &str| -> BTreeSet<String> {
        let mut s = base.clone();
        s.insert(n.to_string());
        s
    };
    // (the change, steps it takes, the volumes after it)
    type Change = (&'static str, Value, u64);
    let changes: Vec<Change> = vec![
        ("CreateLV", json!({"name": "new", "size_bytes": 8 * MIB}), 4),
        (
            "CreateLVSnapshot",
            json!({"name": "snap", "source_volume": "base"}),
            5,
        ),
        ("ResizeLV", json!({"name": "base", "size_bytes": 128 * MIB}), 3),
        ("RemoveLV", json!({"name": "base"}), 3),
    ];
    for (rpc, req, steps) in changes {
        for k in 1..=steps {
            // the state before the change
            let mut l = Lvmd::start(&d, &cfg, &[]);
            let names = l.names();
            for n in names.difference(&base) {
                l.ok("lv", "RemoveLV", json!({"name": n}));
            }
            if !l.names().contains("base") {
                l.ok("lv", "CreateLV", json!({"name": "base", "size_bytes": 64 * MIB}));
                Nbd::connect(&d.sock(), "base").write(0, &common::pattern(7, MIB as usize));
            }
            if table_bytes(&d, "base") != 64 * MIB {
                // a volume does not shrink: make it again at its size
                l.ok("lv", "RemoveLV", json!({"name": "base"}));
                l.ok("lv", "CreateLV", json!({"name": "base", "size_bytes": 64 * MIB}));
                Nbd::connect(&d.sock(), "base").write(0, &common::pattern(7, MIB as usize));
            }
            consistent(&d, &mut l);
            drop(l);
            // the change, stopped after step k
            let mut l = Lvmd::start(&d, &cfg, &["--test-exit-after-steps", &k.to_string()]);
            let r = l.call("lv", rpc, req.clone());
            assert!(r.is_err(), "{rpc} stopped after step {k} answered {r:?}");
            assert_eq!(l.wait_exit(), 137, "{rpc}: lvmd stopped after step {k}");
            assert!(
                log_of(&d).contains(&format!("exiting after step {k} (--test-exit-after-steps)")),
                "the test option is logged"
            );
            // the next lvmd finishes or undoes it, and says so
            let seen = log_of(&d).len();
            let mut l = Lvmd::start(&d, &cfg, &[]);
            let said = log_of(&d)[seen..].to_string();
            let expect = match rpc {
                "CreateLV" | "CreateLVSnapshot" if k < steps => Some("a create left half done"),
                "RemoveLV" => Some("a remove left half done"),
                "ResizeLV" if k < steps => Some("finishing its resize"),
                _ => None,
            };
            match expect {
                Some(e) => assert!(said.contains(e), "{rpc} after step {k}: '{e}' not in {said}"),
                None => assert!(
                    !said.contains("volume "),
                    "{rpc} after step {k}: nothing to recover: {said}"
                ),
            }
            let names = consistent(&d, &mut l);
            match rpc {
                "CreateLV" if k < steps => assert_eq!(names, base, "{rpc} undone after step {k}"),
                "CreateLV" => assert_eq!(names, with("new")),
                "CreateLVSnapshot" if k < steps => assert_eq!(names, base, "{rpc} undone after step {k}"),
                "CreateLVSnapshot" => {
                    assert_eq!(names, with("snap"));
                    assert_eq!(
                        Nbd::connect(&d.sock(), "snap").read(0, MIB as usize),
                        common::pattern(7, MIB as usize)
                    );
                }
                "ResizeLV" => {
                    // recorded before the first step: finished
                    assert_eq!(names, base);
                    assert_eq!(table_bytes(&d, "base"), 128 * MIB, "{rpc} after step {k}");
                    let listed = l.ok("vg", "GetLVList", json!({"device_class": "thin"}));
                    assert_eq!(int(&listed["volumes"][0]["size_bytes"]), 128 * MIB);
                }
                _ => assert!(names.is_empty(), "{rpc} finished after step {k}: {names:?}"),
            }
        }
    }
}

/// thin_delta 1.x's changed blocks between thin devices A and B of the pool,
/// read from a metadata snapshot as on a live kernel pool.
fn reference_delta(d: &Daemon, a: u64, b: u64) -> BTreeSet<u64> {
    d.ok(&["message", "pool", "0", "reserve_metadata_snap"]);
    let o = Command::new(thin_util::tool("thin_delta"))
        .args(["-m", "--snap1", &a.to_string(), "--snap2", &b.to_string()])
        .arg(d.dir.path("meta.img"))
        .output()
        .unwrap();
    d.ok(&["message", "pool", "0", "release_metadata_snap"]);
    assert!(
        o.status.success(),
        "thin_delta: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut set = BTreeSet::new();
    for l in String::from_utf8_lossy(&o.stdout).lines() {
        let l = l.trim();
        if l.starts_with("<same") || !(l.starts_with("<different") || l.contains("_only")) {
            continue;
        }
        let attr = |k: &str| -> u64 {
            let at = l.find(&format!("{k}=\"")).unwrap() + k.len() + 2;
            l[at..].split('"').next().unwrap().parse().unwrap()
        };
        let (begin, len) = (attr("begin"), attr("length"));
        set.extend(begin..begin + len);
    }
    set
}

/// The blocks a SnapshotMetadata stream names, checked as the spec asks
/// (one kind, one capacity, increasing and not overlapping, at most `per`
/// tuples a message).
fn blocks(msgs: &Value, capacity: u64, per: usize) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    let mut end = 0;
    for m in msgs.as_array().unwrap() {
        assert_eq!(int(&m["block_metadata_type"]), 1, "FIXED_LENGTH");
        assert_eq!(int(&m["volume_capacity_bytes"]), capacity);
        let t = m["block_metadata"].as_array().unwrap();
        assert!(t.len() <= per, "{} tuples, max_results {per}", t.len());
        for b in t {
            let (off, len) = (int(&b["byte_offset"]), int(&b["size_bytes"]));
            assert_eq!(len, BLOCK);
            assert!(off >= end, "tuples overlap or go back");
            end = off + len;
            set.insert(off / BLOCK);
        }
    }
    set
}

fn delta(l: &mut Lvmd, base: &str, target: &str, capacity: u64) -> BTreeSet<u64> {
    let per = 100;
    let m = l.ok(
        "sm",
        "GetMetadataDelta",
        json!({"base_snapshot_id": base, "target_snapshot_id": target, "max_results": per}),
    );
    blocks(&m, capacity, per as usize)
}

/// A volume's thin id, from lvmd's record of it.
fn dev_id(d: &Daemon, name: &str) -> u64 {
    let rec: Value =
        serde_json::from_slice(&std::fs::read(d.run.join(format!("lvmd/{name}.json"))).unwrap()).unwrap();
    int(&rec["dev_id"])
}

#[test]
fn snapshot_metadata_deltas_equal_thin_delta_and_restore_backups_exactly() {
    // 20 snapshots: 20 generations of backup, 380 ordered pairs (LVMD_DELTA_SNAPSHOTS=101 gives 10,100)
    let gens: usize = std::env::var("LVMD_DELTA_SNAPSHOTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let d = Daemon::start("lvmd-delta");
    let cfg = pool(&d, "100.0");
    let mut l = Lvmd::start(&d, &cfg, &[]);
    let cap = 64 * MIB;
    l.ok("lv", "CreateLV", json!({"name": "vol", "size_bytes": cap}));
    let mut rng = common::Rng(0x1d5);
    let mut vol = Nbd::connect(&d.sock(), "vol");
    // the backup: a full copy of the first snapshot, then each next from deltas
    let mut backup = vec![0u8; cap as usize];
    for g in 0..gens {
        for _ in 0..rng.below(40) + 1 {
            let off = rng.below(cap / 4096) * 4096;
            let len = ((rng.below(16) + 1) * 4096).min(cap - off);
            vol.write(off, &common::pattern(rng.next(), len as usize));
        }
        if g % 3 == 2 {
            // whole blocks discarded: mapped in the last snapshot, not in this one
            let b = rng.below(cap / BLOCK);
            vol.call(nbd::TRIM, 0, b * BLOCK, BLOCK as u32, &[]);
        }
        let name = format!("s{g}");
        l.ok(
            "lv",
            "CreateLVSnapshot",
            json!({"name": name, "source_volume": "vol", "access_type": "ro"}),
        );
        let mut snap = Nbd::connect(&d.sock(), &name);
        if g == 0 {
            let m = l.ok(
                "sm",
                "GetMetadataAllocated",
                json!({"snapshot_id": "s0", "max_results": 7}),
            );
            for b in blocks(&m, cap, 7) {
                let at = (b * BLOCK) as usize;
                backup[at..at + BLOCK as usize].copy_from_slice(&snap.read(b * BLOCK, BLOCK as usize));
            }
        } else {
            for b in delta(&mut l, &format!("s{}", g - 1), &name, cap) {
                let at = (b * BLOCK) as usize;
                backup[at..at + BLOCK as usize].copy_from_slice(&snap.read(b * BLOCK, BLOCK as usize));
            }
        }
        let whole = common::read_all(&mut snap, cap);
        assert!(
            whole == backup,
            "generation {g}: the backup restored from deltas differs from the snapshot"
        );
    }
    drop(vol);
    println!("{gens} generations: the backup made from deltas equals each snapshot");

    // every ordered pair: lvmd's delta equals thin_delta 1.x's
    let id = |n: &str| dev_id(&d, n);
    let mut pairs = 0;
    let mut changed = 0;
    for a in 0..gens {
        for b in 0..gens {
            if a == b {
                continue;
            }
            let (sa, sb) = (format!("s{a}"), format!("s{b}"));
            let ours = delta(&mut l, &sa, &sb, cap);
            let theirs = reference_delta(&d, id(&sa), id(&sb));
            assert_eq!(ours, theirs, "delta {sa} -> {sb}");
            pairs += 1;
            changed += ours.len();
        }
    }
    assert!(changed > 0);
    println!("{pairs} pairs: GetMetadataDelta equals thin_delta 1.x ({changed} changed blocks in all)");

    // CSI's Identity beside it, as the snapshot-metadata sidecar asks it
    let info = l.ok("id", "GetPluginInfo", json!({}));
    assert_eq!(info["name"], "topolvm.io");
    let caps = l.ok("id", "GetPluginCapabilities", json!({}));
    assert_eq!(
        caps["capabilities"][0]["service"]["type"], 4,
        "SNAPSHOT_METADATA_SERVICE: {caps}"
    );
    let probe = l.ok("id", "Probe", json!({}));
    assert_eq!(probe["ready"]["value"], true, "{probe}");

    // a lvmd stopped while it holds the pool's metadata snapshot: the next one releases it
    drop(l);
    let mut l = Lvmd::start(&d, &cfg, &["--test-exit-after-steps", "1"]);
    assert!(l
        .call("sm", "GetMetadataAllocated", json!({"snapshot_id": "s1"}))
        .is_err());
    assert_eq!(l.wait_exit(), 137);
    let seen = log_of(&d).len();
    let mut l = Lvmd::start(&d, &cfg, &[]);
    assert!(log_of(&d)[seen..].contains("releasing the metadata snapshot a stopped lvmd held"));
    l.ok("sm", "GetMetadataAllocated", json!({"snapshot_id": "s1"}));

    // allocated: the snapshot's mapped blocks, also from an offset
    let all = blocks(
        &l.ok("sm", "GetMetadataAllocated", json!({"snapshot_id": "s5"})),
        cap,
        1024,
    );
    let first = *all.iter().next().unwrap();
    let later = blocks(
        &l.ok(
            "sm",
            "GetMetadataAllocated",
            json!({"snapshot_id": "s5", "starting_offset": first * BLOCK + 1}),
        ),
        cap,
        1024,
    );
    assert_eq!(later, all, "a block that ends after starting_offset is in");
    let from_next = blocks(
        &l.ok(
            "sm",
            "GetMetadataAllocated",
            json!({"snapshot_id": "s5", "starting_offset": (first + 1) * BLOCK}),
        ),
        cap,
        1024,
    );
    assert_eq!(from_next.len(), all.len() - 1);

    // bad requests get the spec's codes; the server goes on
    l.fails(
        "sm",
        "GetMetadataAllocated",
        json!({"snapshot_id": "nope"}),
        "NOT_FOUND",
    );
    l.fails(
        "sm",
        "GetMetadataDelta",
        json!({"base_snapshot_id": "s1", "target_snapshot_id": "nope"}),
        "NOT_FOUND",
    );
    l.fails(
        "sm",
        "GetMetadataAllocated",
        json!({"snapshot_id": "s1", "starting_offset": cap}),
        "OUT_OF_RANGE",
    );
    l.fails(
        "sm",
        "GetMetadataAllocated",
        json!({"snapshot_id": "s1", "starting_offset": -1}),
        "INVALID_ARGUMENT",
    );
    l.fails(
        "sm",
        "GetMetadataAllocated",
        json!({"snapshot_id": "s1", "max_results": -3}),
        "INVALID_ARGUMENT",
    );
    l.ok("lv", "CreateLV", json!({"name": "other", "size_bytes": cap}));
    l.ok(
        "lv",
        "CreateLVSnapshot",
        json!({"name": "o1", "source_volume": "other"}),
    );
    l.fails(
        "sm",
        "GetMetadataDelta",
        json!({"base_snapshot_id": "s1", "target_snapshot_id": "o1"}),
        "INVALID_ARGUMENT",
    );

    // pages of 2 runs (a test-only option): the same answers through gRPC,
    // each read from its own metadata snapshot, from where the last page ended
    let last = format!("s{}", gens - 1);
    let one_page = delta(&mut l, "s1", &last, cap);
    let runs = |set: &BTreeSet<u64>| set.iter().filter(|&&b| b == 0 || !set.contains(&(b - 1))).count();
    assert!(
        runs(&all) > 4 && runs(&one_page) > 4,
        "{} and {} runs",
        runs(&all),
        runs(&one_page)
    );
    drop(l);
    let seen = log_of(&d).len();
    let mut l = Lvmd::start(&d, &cfg, &["--test-page-runs", "2"]);
    assert!(log_of(&d)[seen..].contains("SnapshotMetadata reads pages of 2 runs (--test-page-runs)"));
    let paged = blocks(
        &l.ok(
            "sm",
            "GetMetadataAllocated",
            json!({"snapshot_id": "s5", "max_results": 3}),
        ),
        cap,
        3,
    );
    assert_eq!(paged, all, "GetMetadataAllocated in pages of 2 runs");
    assert_eq!(
        delta(&mut l, "s1", &last, cap),
        one_page,
        "GetMetadataDelta in pages of 2 runs"
    );
    println!(
        "in pages of 2 runs: the same {} allocated blocks ({} runs) and {} changed ({} runs)",
        all.len(),
        runs(&all),
        one_page.len(),
        runs(&one_page)
    );
    drop(l);
    let mut l = Lvmd::start(&d, &cfg, &[]);

    // a kill of the daemon and a restore: the deltas are the same, from the pool's metadata
    let before = delta(&mut l, "s1", &format!("s{}", gens - 1), cap);
    drop(l);
    let d = d.kill9_and_restore();
    let mut l = Lvmd::start(&d, &cfg, &[]);
    assert_eq!(delta(&mut l, "s1", &format!("s{}", gens - 1), cap), before);
    println!(
        "after kill -9 and serve --restore: the same delta ({} blocks)",
        before.len()
    );
}
