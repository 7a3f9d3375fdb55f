//! TLS on the NBD export (`dmkit serve --tls`), through the real daemon and real
//! clients: libnbd's nbdinfo and nbdcopy (GnuTLS), qemu-img, and raw sockets for
//! what the protocol says a server answers before TLS.

use crate::common;

use common::nbd::{self, opt_reply, send_opt};
use common::{need_all, pattern, run, Daemon, Scratch};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::MIB;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_ERR_UNSUP: u32 = 0x8000_0001;
const REP_ERR_TLS_REQD: u32 = 0x8000_0005;

/// Credentials made the way the README says: a PSK file by psktool (identity
/// alice), a CA, a server certificate for localhost and a client certificate by
/// openssl; and for the failures, a second PSK file with alice's key wrong, a
/// client certificate of another CA, and an expired server certificate (certtool,
/// which can date one in the past).
struct Creds {
    dir: Scratch,
}

const MAKE_CREDS: &str = r#"
set -e
psktool -u alice -p psk/keys.psk >/dev/null
sed 's/:.*/:00112233445566778899aabbccddeeff/' psk/keys.psk > psk-wrong/keys.psk
psktool -u mallory -p psk-unknown/keys.psk >/dev/null
cat psk/keys.psk psk-unknown/keys.psk > psk-two.psk
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $ec -keyout ca-key.pem -out ca-cert.pem -days 30 -subj /CN=dmkit-test-ca 2>/dev/null
openssl req $ec -keyout server/server-key.pem -out server.csr -subj /CN=localhost 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > server.ext
openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
  -days 30 -extfile server.ext -out server/server-cert.pem 2>/dev/null
openssl req $ec -keyout client/client-key.pem -out client.csr -subj /CN=alice 2>/dev/null
printf 'extendedKeyUsage=clientAuth\n' > client.ext
openssl x509 -req -in client.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
  -days 30 -extfile client.ext -out client/client-cert.pem 2>/dev/null
cp ca-cert.pem server/ && cp ca-cert.pem client/ && cp ca-cert.pem rogue/
openssl req -x509 $ec -keyout rogue-ca-key.pem -out rogue-ca-cert.pem -days 30 -subj /CN=rogue-ca 2>/dev/null
openssl req $ec -keyout rogue/client-key.pem -out rogue.csr -subj /CN=alice 2>/dev/null
openssl x509 -req -in rogue.csr -CA rogue-ca-cert.pem -CAkey rogue-ca-key.pem -CAcreateserial \
  -days 30 -extfile client.ext -out rogue/client-cert.pem 2>/dev/null
cp ca-cert.pem expired/
cp server/server-key.pem expired/
printf 'cn = localhost\ndns_name = localhost\ntls_www_server\nactivation_date = "2020-01-01 00:00:00"\nexpiration_date = "2021-01-01 00:00:00"\n' > expired.tmpl
certtool --generate-certificate --load-privkey expired/server-key.pem \
  --load-ca-certificate ca-cert.pem --load-ca-privkey ca-key.pem \
  --template expired.tmpl --outfile expired/server-cert.pem >/dev/null 2>&1
"#;

impl Creds {
    fn new() -> Creds {
        need_all(&["psktool", "openssl", "certtool"]);
        let dir = Scratch::new("tls-creds");
        for d in [
            "psk",
            "psk-wrong",
            "psk-unknown",
            "server",
            "client",
            "rogue",
            "expired",
        ] {
            std::fs::create_dir_all(dir.path(d)).expect("credentials directory");
        }
        run(Command::new("bash").arg("-c").arg(MAKE_CREDS).current_dir(&dir.0));
        Creds { dir }
    }
    fn path(&self, p: &str) -> PathBuf {
        self.dir.path(p)
    }
    fn arg(&self, p: &str) -> String {
        self.path(p).display().to_string()
    }
}

/// A free TCP port on loopback.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("address").port()
}

/// A daemon with `args` and device `d`: linear over a file of `mib` MiB.
fn daemon(tag: &str, args: &[&str], mib: u64) -> (Daemon, PathBuf) {
    let d = Daemon::start_with(tag, args, &[]);
    let f = d.dir.sparse("disk", mib * MIB);
    d.create("d", &format!("0 {} linear {} 0", mib * MIB / 512, f.display()));
    (d, f)
}

/// The URI of export `d` over TLS on the unix socket, with `query` appended.
fn tls_unix(d: &Daemon, user: &str, query: &str) -> String {
    format!("nbds+unix://{user}/d?socket={}&{query}", d.sock().display())
}

fn md5(p: &Path) -> String {
    let out = run(Command::new("md5sum").arg(p));
    out.split_whitespace().next().expect("md5sum output").to_string()
}

/// nbdcopy `from` to `to`; either may be a URI or a file.
fn nbdcopy(from: &str, to: &str) {
    run(Command::new("nbdcopy").arg(from).arg(to));
}

/// Run a command expected to fail; returns its stderr.
fn fails(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        !o.status.success(),
        "{cmd:?} succeeded: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn nbdinfo(uri: &str) -> Command {
    let mut c = Command::new("nbdinfo");
    c.arg(uri);
    c
}

/// Write a random image (of `seed`) through `write_uri`, read it back through each of
/// `read_uris`: equal, and equal to the backing file.
fn round_trip(s: &Scratch, backing: &Path, seed: u64, write_uri: &str, read_uris: &[&str]) {
    let src = s.path("src.bin");
    let size = std::fs::metadata(backing).expect("backing file").len();
    std::fs::write(&src, pattern(seed, size as usize)).expect("source image");
    nbdcopy(&src.display().to_string(), write_uri);
    let want = md5(&src);
    assert_eq!(
        md5(backing),
        want,
        "backing file after writing through {write_uri}"
    );
    for (i, uri) in read_uris.iter().enumerate() {
        let out = s.path(&format!("out{i}.bin"));
        nbdcopy(uri, &out.display().to_string());
        assert_eq!(md5(&out), want, "read back through {uri}");
    }
}

/// The daemon's thread count.
fn threads(d: &Daemon) -> u32 {
    std::fs::read_to_string(format!("/proc/{}/status", d.pid()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Wait (up to 5 s) for the daemon's thread count to come back to `n`.
fn wait_threads(d: &Daemon, n: u32) {
    let t0 = std::time::Instant::now();
    while threads(d) != n {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "threads: {} where {n} were before",
            threads(d)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn psk_nbdinfo_nbdcopy_unix_and_tcp() {
    need_all(&["nbdinfo", "nbdcopy", "md5sum"]);
    let c = Creds::new();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let psk = c.arg("psk/keys.psk");
    let (d, f) = daemon(
        "tls-psk",
        &["--tls", "on", "--tls-psk", &psk, "--nbd-listen", &listen],
        16,
    );
    let q = format!("tls-psk-file={psk}");
    let info = run(&mut nbdinfo(&tls_unix(&d, "alice@", &q)));
    assert!(
        info.lines().next() == Some("protocol: newstyle-fixed with TLS, using structured packets"),
        "{info}"
    );
    assert!(info.contains("\texport-size: 16777216 (16M)\n"), "{info}");
    let tcp = format!("nbds://alice@127.0.0.1:{port}/d?{q}");
    let plain = d.uri("d");
    round_trip(&d.dir, &f, 1, &tls_unix(&d, "alice@", &q), &[&tcp, &plain]);
    // and written over TCP
    let s = Scratch::new("tls-psk-tcp");
    round_trip(&s, &f, 2, &tcp, &[&plain]);
    // --tls on: plain clients are served as before
    let info = run(&mut nbdinfo(&plain));
    assert!(
        info.lines().next() == Some("protocol: newstyle-fixed without TLS, using structured packets"),
        "{info}"
    );
}

#[test]
fn psk_wrong_key_or_unknown_identity_fails() {
    need_all(&["nbdinfo", "nbdcopy", "md5sum"]);
    let c = Creds::new();
    let (d, f) = daemon(
        "tls-psk-bad",
        &["--tls", "require", "--tls-psk", &c.arg("psk/keys.psk")],
        8,
    );
    let good = format!("tls-psk-file={}", c.arg("psk/keys.psk"));
    round_trip(&d.dir, &f, 3, &tls_unix(&d, "alice@", &good), &[]);
    let before = md5(&f);
    let src = d.dir.path("src.bin").display().to_string();
    std::fs::write(d.dir.path("src.bin"), pattern(0xBAD, (8 * MIB) as usize)).expect("image");
    for (user, file) in [
        ("alice@", "psk-wrong/keys.psk"),
        ("mallory@", "psk-unknown/keys.psk"),
    ] {
        let uri = tls_unix(&d, user, &format!("tls-psk-file={}", c.arg(file)));
        fails(&mut nbdinfo(&uri));
        fails(Command::new("nbdcopy").arg(&src).arg(&uri));
    }
    assert_eq!(md5(&f), before, "the export changed through a refused client");
    assert!(d.log().contains("unknown PSK identity 'mallory'"), "{}", d.log());
    // the daemon still serves the right key
    run(&mut nbdinfo(&tls_unix(&d, "alice@", &good)));
}

#[test]
fn x509_verify_peer_unix_and_tcp() {
    need_all(&["nbdinfo", "nbdcopy", "md5sum"]);
    let c = Creds::new();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let args = [
        "--tls",
        "require",
        "--tls-certificates",
        &c.arg("server"),
        "--tls-verify-peer",
        "--nbd-listen",
        &listen,
        "--tls-allow",
        "d=alice",
        "--tls-allow",
        "other=bob,carol",
    ];
    let (d, f) = daemon("tls-x509", &args, 8);
    d.create("other", "0 2048 zero");
    let q = format!("tls-certificates={}", c.arg("client"));
    let unix = tls_unix(&d, "", &q);
    let tcp = format!("nbds://localhost:{port}/d?{q}");
    let info = run(&mut nbdinfo(&unix));
    assert!(
        info.lines().next() == Some("protocol: newstyle-fixed with TLS, using structured packets"),
        "{info}"
    );
    round_trip(&d.dir, &f, 4, &unix, &[&tcp]);
    // export "other" is for bob and carol: the certificate of CN alice does not see it
    let other = format!("nbds://localhost:{port}/other?{q}");
    let err = fails(&mut nbdinfo(&other));
    assert!(
        err.starts_with("nbdinfo: nbd_opt_go: server replied with error to opt_go request: No such file or directory for export: other\n"),
        "{err}"
    );
    let before = md5(&f);
    // a client certificate of another CA: refused, nothing written
    let rogue = tls_unix(&d, "", &format!("tls-certificates={}", c.arg("rogue")));
    let src = d.dir.path("src.bin").display().to_string();
    std::fs::write(d.dir.path("src.bin"), pattern(0xBAD, (8 * MIB) as usize)).expect("image");
    fails(&mut nbdinfo(&rogue));
    fails(Command::new("nbdcopy").arg(&src).arg(&rogue));
    assert_eq!(md5(&f), before, "the export changed through a refused client");
    run(&mut nbdinfo(&unix));
}

#[test]
fn expired_server_certificate_fails_a_verifying_client() {
    need_all(&["nbdinfo", "md5sum"]);
    let c = Creds::new();
    let listen = format!("127.0.0.1:{}", free_port());
    let args = [
        "--tls",
        "require",
        "--tls-certificates",
        &c.arg("expired"),
        "--nbd-listen",
        &listen,
    ];
    let (d, f) = daemon("tls-expired", &args, 8);
    std::fs::write(&f, pattern(0xE1, (8 * MIB) as usize)).expect("fill");
    let before = md5(&f);
    // over TCP: libnbd 1.14 checks no server certificate over a unix socket
    // (it has no host name to check it against)
    let port = listen.rsplit_once(':').map(|(_, p)| p).unwrap_or_default();
    let uri = format!("nbds://localhost:{port}/d?tls-certificates={}", c.arg("client"));
    let err = fails(&mut nbdinfo(&uri));
    assert!(
        err.contains("gnutls_handshake: Error in the certificate verification"),
        "{err}"
    );
    let src = d.dir.path("src.bin").display().to_string();
    std::fs::write(d.dir.path("src.bin"), pattern(0xBAD, (8 * MIB) as usize)).expect("image");
    fails(Command::new("nbdcopy").arg(&src).arg(&uri));
    assert_eq!(md5(&f), before, "the export changed through a refused client");
}

/// Greet, then ask for `opt`; the reply's type.
fn answer(s: &mut std::os::unix::net::UnixStream, opt: u32, data: &[u8]) -> u32 {
    send_opt(s, opt, data);
    opt_reply(s).0
}

fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

#[test]
fn require_refuses_plain_clients() {
    need_all(&["nbdinfo"]);
    let c = Creds::new();
    let (d, _f) = daemon(
        "tls-require",
        &["--tls", "require", "--tls-psk", &c.arg("psk/keys.psk")],
        8,
    );
    let mut s = nbd::greet(&d.sock());
    for (opt, data) in [
        (OPT_STRUCTURED_REPLY, vec![]),
        (OPT_LIST, vec![]),
        (OPT_INFO, go_data("d")),
        (OPT_GO, go_data("d")),
        (42, vec![1, 2, 3]),
    ] {
        assert_eq!(answer(&mut s, opt, &data), REP_ERR_TLS_REQD, "option {opt}");
    }
    assert_eq!(answer(&mut s, OPT_ABORT, &[]), REP_ACK);
    // EXPORT_NAME has no error reply: the server hangs up
    let mut s = nbd::greet(&d.sock());
    send_opt(&mut s, OPT_EXPORT_NAME, b"d");
    assert!(
        nbd::closed_within(&mut s, Duration::from_secs(5)),
        "EXPORT_NAME before TLS answered"
    );
    let err = fails(&mut nbdinfo(&d.uri("d")));
    assert!(
        err.starts_with("nbdinfo: nbd_opt_go: server replied with error to opt_go request"),
        "{err}"
    );
    // STARTTLS with data is invalid; the options go on
    let mut s = nbd::greet(&d.sock());
    assert_eq!(answer(&mut s, OPT_STARTTLS, &[1]), 0x8000_0003);
    assert_eq!(answer(&mut s, OPT_GO, &go_data("d")), REP_ERR_TLS_REQD);
}

#[test]
fn off_answers_starttls_unsupported() {
    let d = Daemon::start("tls-off");
    let mut s = nbd::greet(&d.sock());
    assert_eq!(answer(&mut s, OPT_STARTTLS, &[]), REP_ERR_UNSUP);
}

#[test]
fn bad_options_refuse_to_start() {
    let c = Creds::new();
    let dir = Scratch::new("tls-opts");
    let start = |args: &[&str]| {
        let o = Command::new(common::BIN)
            .arg("serve")
            .arg("--run-dir")
            .arg(dir.path("run"))
            .args(args)
            .output()
            .expect("spawn dmkit serve");
        assert!(!o.status.success(), "dmkit serve {args:?} started");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let err = start(&["--tls", "on"]);
    assert!(
        err.contains("--tls on: give --tls-certificates DIR or --tls-psk FILE"),
        "{err}"
    );
    let err = start(&["--tls-psk", &c.arg("psk/keys.psk")]);
    assert!(err.contains("need --tls on or --tls require"), "{err}");
    let bad = dir.path("bad.psk");
    std::fs::write(&bad, "alice:00ff\nbob:xyz1\n").expect("psk file");
    let err = start(&["--tls", "on", "--tls-psk", &bad.display().to_string()]);
    assert!(
        err.contains("bad.psk: line 2: the key is not hexadecimal"),
        "{err}"
    );
    let big = dir.path("big.psk");
    std::fs::write(&big, "a:00\n".repeat(300_000)).expect("psk file");
    let err = start(&["--tls", "on", "--tls-psk", &big.display().to_string()]);
    assert!(
        err.contains("big.psk: a PSK file is at most 1048576 bytes"),
        "{err}"
    );
    let err = start(&["--tls", "on", "--tls-certificates", &c.arg("psk")]);
    assert!(err.contains("loading the server certificate"), "{err}");
}

/// STARTTLS acknowledged on a fresh connection.
fn started(d: &Daemon) -> std::os::unix::net::UnixStream {
    let mut s = nbd::greet(&d.sock());
    assert_eq!(answer(&mut s, OPT_STARTTLS, &[]), REP_ACK);
    s
}

#[test]
fn hostile_and_dropped_tls_handshakes_cost_nothing() {
    need_all(&["nbdinfo", "nbdcopy", "md5sum"]);
    let c = Creds::new();
    let psk = c.arg("psk/keys.psk");
    let (d, f) = daemon("tls-hostile", &["--tls", "on", "--tls-psk", &psk], 8);
    let q = format!("tls-psk-file={psk}");
    // a TLS client attached through the abuse
    let mut by = nbd::Client::connect(&d.sock(), "d");
    // the bystander's handshake thread has gone (it hands the connection to a
    // reactor, then ends)
    let t0 = std::time::Instant::now();
    while !d.ok(&["stats", "--server"]).contains(" handshakes=0 ") {
        assert!(t0.elapsed() < Duration::from_secs(5), "a handshake never ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(50));
    let base = threads(&d);
    // garbage instead of a ClientHello: that connection is closed
    let mut s = started(&d);
    s.write_all(&[0x42; 512]).expect("garbage");
    assert!(
        nbd::closed_within(&mut s, Duration::from_secs(5)),
        "garbage handshake kept open"
    );
    // a ClientHello cut short, then the client goes
    let mut s = started(&d);
    s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .expect("partial hello");
    drop(s);
    // a client that goes right after the ACK
    drop(started(&d));
    wait_threads(&d, base);
    round_trip(&d.dir, &f, 5, &tls_unix(&d, "alice@", &q), &[&d.uri("d")]);
    let data = pattern(0xB1, 4096);
    by.write(0, &data);
    assert_eq!(by.read(0, 4096), data, "bystander read-back");
}

#[test]
fn qemu_img_over_tls_psk_and_x509() {
    need_all(&["qemu-img", "md5sum"]);
    let c = Creds::new();
    let cases = [
        (
            ["--tls-psk", &c.arg("psk/keys.psk")],
            format!(
                "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
                c.arg("psk")
            ),
        ),
        (
            ["--tls-certificates", &c.arg("server")],
            format!(
                "tls-creds-x509,id=tls0,endpoint=client,dir={},verify-peer=on",
                c.arg("client")
            ),
        ),
    ];
    for (i, (creds, object)) in cases.iter().enumerate() {
        let (d, f) = daemon("tls-qemu", &["--tls", "require", creds[0], creds[1]], 8);
        let sock = d.sock().display().to_string();
        let src = d.dir.path("src.bin");
        std::fs::write(&src, pattern(0x900 + i as u64, (8 * MIB) as usize)).expect("image");
        let target = format!("driver=nbd,path={sock},export=d,tls-creds=tls0,tls-hostname=localhost");
        run(Command::new("qemu-img")
            .args([
                "convert",
                "-n",
                "-f",
                "raw",
                "--object",
                object,
                "--target-image-opts",
            ])
            .arg(&src)
            .arg(&target));
        assert_eq!(md5(&f), md5(&src), "written by qemu-img over {object}");
        let out = d.dir.path("out.bin");
        let _ = std::fs::remove_file(&out);
        run(Command::new("qemu-img")
            .args([
                "convert",
                "-O",
                "raw",
                "--object",
                object,
                "--image-opts",
                &target,
            ])
            .arg(&out));
        assert_eq!(md5(&out), md5(&src), "read by qemu-img over {object}");
    }
}

#[test]
fn tls_allow_hides_exports_from_other_identities() {
    need_all(&["nbdinfo"]);
    let c = Creds::new();
    let two = c.arg("psk-two.psk");
    let args = ["--tls", "on", "--tls-psk", &two, "--tls-allow", "secret=alice"];
    let (d, _f) = daemon("tls-allow", &args, 8);
    d.create("secret", "0 2048 zero");
    let q = format!("tls-psk-file={two}");
    let sock = d.sock().display().to_string();
    let uri = |user: &str, export: &str| format!("nbds+unix://{user}@/{export}?socket={sock}&{q}");
    let info = run(&mut nbdinfo(&uri("alice", "secret")));
    assert!(info.contains("\texport-size: 1048576 (1M)\n"), "{info}");
    let list = run(nbdinfo(&uri("alice", "")).arg("--list").arg("--json"));
    assert!(
        list.contains("\"export-name\": \"secret\"") && list.contains("\"export-name\": \"d\""),
        "{list}"
    );
    // mallory (a known key) and plain clients see only d
    let err = fails(&mut nbdinfo(&uri("mallory", "secret")));
    assert!(
        err.starts_with("nbdinfo: nbd_opt_go: server replied with error to opt_go request: No such file or directory for export: secret\n"),
        "{err}"
    );
    let list = run(nbdinfo(&uri("mallory", "")).arg("--list").arg("--json"));
    assert!(
        !list.contains("secret") && list.contains("\"export-name\": \"d\""),
        "{list}"
    );
    run(&mut nbdinfo(&uri("mallory", "d")));
    // the refusal is the one for an export that does not exist
    let mut s = nbd::greet(&d.sock());
    send_opt(&mut s, OPT_GO, &go_data("secret"));
    let hidden = opt_reply(&mut s);
    send_opt(&mut s, OPT_GO, &go_data("nothing"));
    let (typ, absent) = opt_reply(&mut s);
    assert_eq!((hidden.0, typ), (0x8000_0006, 0x8000_0006));
    let text = |p: &[u8]| String::from_utf8_lossy(p).replace("nothing", "secret");
    assert_eq!(text(&hidden.1), text(&absent));
}

#[test]
fn psk_in_tls_1_3_and_1_2() {
    need_all(&["nbdinfo"]);
    let c = Creds::new();
    let psk = c.arg("psk/keys.psk");
    let d = Daemon::start_with(
        "tls-versions",
        &["--tls", "require", "--tls-psk", &psk],
        &[("RUST_LOG", "debug")],
    );
    d.create("d", "0 2048 zero");
    let uri = tls_unix(&d, "alice@", &format!("tls-psk-file={psk}"));
    assert_eq!(run(nbdinfo(&uri).arg("--size")), "1048576\n");
    // GnuTLS with TLS 1.3 turned off by its system priority file
    let prio = c.path("tls12.conf");
    std::fs::write(&prio, "[overrides]\ndisabled-version = tls1.3\n").expect("priority file");
    let out = run(nbdinfo(&uri)
        .arg("--size")
        .env("GNUTLS_SYSTEM_PRIORITY_FILE", &prio));
    assert_eq!(out, "1048576\n");
    let log = d.log();
    assert!(
        log.contains("nbd: TLS client alice (TLSv1.3, TLS_AES_128_GCM_SHA256)"),
        "{log}"
    );
    assert!(
        log.contains("nbd: TLS client alice (TLSv1.2, ECDHE-PSK-"),
        "{log}"
    );
}

/// fio's jobs over TLS (X.509), moved between CPUs: their connections follow
/// them, TLS session and all, and every write reads back as written
/// (`common::placement::fio_jobs_follow_their_cpus`).
#[test]
fn tls_connections_follow_their_clients_cpus() {
    let c = Creds::new();
    let home = Scratch::new("tls-home");
    // fio's nbd engine takes X.509 credentials from $HOME/.pki/libnbd only
    let pki = home.path(".pki/libnbd");
    std::fs::create_dir_all(&pki).expect("pki directory");
    for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        std::fs::copy(c.path("client").join(f), pki.join(f)).expect("client credentials");
    }
    let (d, _) = daemon(
        "tls-follow",
        &[
            "--tls",
            "require",
            "--tls-certificates",
            &c.arg("server"),
            "--nbd-reactors",
            "2",
        ],
        64,
    );
    let uri = format!("nbds+unix:///d?socket={}", d.sock().display());
    common::placement::fio_jobs_follow_their_cpus(&d, &uri, Some(&home.0));
}
