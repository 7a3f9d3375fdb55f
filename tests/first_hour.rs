//! What a new user meets in the first hour: usage errors, dmsetup's habits, the
//! daemon in the background, a socket they may not use, a restart after a crash,
//! the tools' links. Real daemon, real CLI.

use crate::common;

use common::{Daemon, Scratch, BIN};

/// The tools alone (src/bin/dmkit-tools.rs), where the multi-call links lead.
const TOOLS: &str = env!("CARGO_BIN_EXE_dmkit-tools");
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `dmkit ARGS` without a daemon.
fn dmkit(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("dmkit")
}

#[test]
fn usage_errors_name_the_missing_argument_and_suggest_the_verb() {
    let cases: [(&[&str], &str); 6] = [
        (&["create"], "dmkit create: the following required arguments were not provided: <NAME> (see 'dmkit create --help')\n"),
        (&["remove"], "dmkit remove: the following required arguments were not provided: <NAME>... (see 'dmkit remove --help')\n"),
        (&["suspend"], "dmkit suspend: the following required arguments were not provided: <NAME>... (see 'dmkit suspend --help')\n"),
        (&["rename"], "dmkit rename: the following required arguments were not provided: <NAME> <NEW_NAME> (see 'dmkit rename --help')\n"),
        (&["message", "pool"], "dmkit message: the following required arguments were not provided: <SECTOR> <MESSAGE>... (see 'dmkit message --help')\n"),
        (&["craete", "x"], "dmkit: unrecognized subcommand 'craete'; some similar subcommands exist: 'cache', 'create' (see 'dmkit --help')\n"),
    ];
    for (args, want) in cases {
        let o = dmkit(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert_eq!(text(&o.stderr), want, "{args:?}");
        assert_eq!(text(&o.stdout), "", "{args:?}");
    }
}

#[test]
fn run_dir_goes_before_or_after_the_verb_and_a_missing_daemon_is_named() {
    let d = Daemon::start("rundir");
    let run = d.run.display().to_string();
    d.create("z", "0 8 zero");
    for args in [
        vec!["--run-dir", &run, "ls"],
        vec!["ls", "--run-dir", &run],
        vec!["ls", &format!("--run-dir={run}")],
    ] {
        let o = dmkit(&args);
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
        assert_eq!(text(&o.stdout), "z\t(511:0)\n", "{args:?}");
    }
    let nowhere = d.dir.path("nowhere");
    let o = dmkit(&["ls", "--run-dir", &nowhere.display().to_string()]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        text(&o.stderr),
        format!(
            "dmkit: no dmkit daemon at {}/control.sock (No such file or directory (os error 2)): \
             start one with `dmkit serve --background`, or name its run directory (--run-dir DIR or DMKIT_RUN_DIR)\n",
            nowhere.display()
        )
    );
}

#[test]
fn info_fields_help_and_errors_without_a_doubled_prefix() {
    let d = Daemon::start("ohelp");
    let help = d.ok(&["info", "-c", "-o", "help"]);
    assert!(help.starts_with("Device-mapper info fields"), "{help}");
    for f in [
        "name",
        "uuid",
        "attr",
        "open",
        "events",
        "devs_used",
        "devnos_used",
    ] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(&format!("{f} "))),
            "{f} in:\n{help}"
        );
    }
    assert!(
        help.ends_with("Default: name,major,minor,attr,open,segments,events,uuid\n"),
        "{help}"
    );
    let e = d.fails(&["info", "-c", "-o", "bogus"]);
    assert!(
        e.starts_with("dmkit info: Unrecognised field: bogus (fields: name, uuid, "),
        "{e}"
    );
    d.create("z", "0 8 zero");
    let e = d.fails(&["message", "z", "x", "hello"]);
    assert_eq!(
        e,
        "dmkit message: invalid sector 'x': a number of 512-byte sectors (0: the first target)\n"
    );
}

#[test]
fn several_names_per_verb_and_devices_picked_by_uuid_or_number() {
    let d = Daemon::start("names");
    d.create("a", "0 8 zero");
    d.create("b", "0 16 zero");
    let o = d.cli_in(&["create", "c", "-u", "UUID-C"], "0 24 zero");
    assert!(o.status.success());
    assert_eq!(d.ok(&["status", "a", "b"]), "a: 0 8 zero \nb: 0 16 zero \n");
    assert_eq!(d.ok(&["table", "b"]), "0 16 zero \n");
    assert_eq!(d.ok(&["table", "-u", "UUID-C"]), "0 24 zero \n");
    assert_eq!(d.ok(&["table", "-j", "511", "-m", "1"]), "0 16 zero \n");
    assert_eq!(
        d.ok(&["info", "-c", "--noheadings", "-o", "name,open", "a", "b"]),
        "a:0\nb:0\n"
    );
    assert_eq!(
        d.ok(&["deps", "a", "b"]),
        "a: 0 dependencies\t:\nb: 0 dependencies\t:\n"
    );
    d.ok(&["suspend", "a", "b"]);
    assert_eq!(
        d.ok(&[
            "info",
            "-c",
            "--noheadings",
            "-o",
            "name,suspended",
            "a",
            "b",
            "c"
        ]),
        "a:Suspended\nb:Suspended\nc:Active\n"
    );
    d.ok(&["resume", "a", "b"]);
    let e = d.cli(&["table", "-j", "8", "-m", "0"]);
    assert_eq!(
        text(&e.stderr),
        "dmkit table: 8:0: No such device (dmkit's devices have major 511)\n"
    );
    // every name is tried; each failure is its own line
    let o = d.cli(&["remove", "a", "nosuch", "b"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(text(&o.stderr), "dmkit remove: nosuch: No such device\n");
    assert_eq!(d.ok(&["ls"]), "c\t(511:2)\n");
    d.ok(&["remove", "-u", "UUID-C"]);
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
}

#[test]
fn dmsetup_script_verbs_remove_all_wait_mknodes_udevcomplete_all() {
    let d = Daemon::start("scriptverbs");
    d.create("low", "0 8 zero");
    d.create("mid", "0 8 linear /dev/mapper/low 0");
    d.create("top", "0 8 linear /dev/mapper/mid 0");
    assert_eq!(d.ok(&["mknodes"]), "");
    assert_eq!(d.ok(&["mknodes", "top"]), "");
    assert_eq!(d.ok(&["udevcomplete_all"]), "");
    assert_eq!(d.ok(&["udevcomplete_all", "5"]), "");
    // wait: at once when the counter is past the number; else until an event
    assert_eq!(d.info_line("low", "Event number:"), "Event number:      0");
    let t0 = Instant::now();
    let mut w = Command::new(BIN)
        .args(["--run-dir", &d.run.display().to_string(), "wait", "low", "0"])
        .spawn()
        .expect("wait");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        w.try_wait().expect("wait").is_none(),
        "wait returned before an event"
    );
    // giving it a uuid is an event
    d.ok(&["rename", "low", "--setuuid", "U-LOW"]);
    assert!(w.wait().expect("wait").success());
    assert!(t0.elapsed() < Duration::from_secs(5));
    d.ok(&["wait", "low", "0"]);
    // users first, so all go
    d.ok(&["remove_all"]);
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
}

#[test]
fn remove_deferred_of_a_held_device_marks_it_until_its_user_goes() {
    let d = Daemon::start("deferred");
    d.create("low", "0 8 zero");
    d.create("top", "0 8 linear /dev/mapper/low 0");
    let e = d.fails(&["remove", "low"]);
    assert_eq!(
        e,
        "dmkit remove: low: Device or resource busy: used by the table of top\n"
    );
    // the kernel marks it and answers success
    assert_eq!(d.ok(&["remove", "--deferred", "low"]), "");
    assert_eq!(
        d.info_line("low", "State:"),
        "State:             ACTIVE (DEFERRED REMOVE)"
    );
    assert_eq!(
        d.ok(&["info", "-c", "--noheadings", "-o", "name,deferred_remove", "low"])
            .trim_end(),
        "low:Deferred remove"
    );
    d.ok(&["remove", "top"]);
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
    // the same when the user's table is swapped for one without it
    d.create("low", "0 8 zero");
    d.create("top", "0 8 linear /dev/mapper/low 0");
    d.ok(&["remove", "--deferred", "low"]);
    d.ok(&["load", "top", "--table", "0 8 zero"]);
    d.ok(&["resume", "top"]);
    // minors are not given again at once: top is the fourth device made
    assert_eq!(d.ok(&["ls"]), "top\t(511:3)\n");
}

#[test]
fn a_socket_this_user_may_not_use_is_a_permission_error_naming_the_remedy() {
    let d = Daemon::start("perm");
    // the scratch directory is the test's; let the unprivileged user through it
    use std::os::unix::fs::PermissionsExt;
    for p in [&d.dir.0, &d.run] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let sock = d.run.join("control.sock");
    let o = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            BIN,
            "--run-dir",
        ])
        .arg(&d.run)
        .arg("ls")
        .output()
        .expect("setpriv");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stderr),
        format!(
            "dmkit: permission denied on the dmkit daemon's socket {} (mode 0600, owner uid 0 gid 0): \
             the daemon is running, but this user may not use it; run as its user, or start the daemon \
             with `dmkit serve --group GROUP` (sockets mode 0660) and join that group\n",
            sock.display()
        )
    );
}

/// `serve --background --run-dir RUN ARGS`: the parent's output once it returned.
fn serve_bg(run: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(["serve", "--background", "--run-dir"])
        .arg(run)
        .args(args)
        .output()
        .expect("serve --background")
}

fn pid_of(run: &Path) -> String {
    std::fs::read_to_string(run.join("serve.pid"))
        .expect("serve.pid")
        .trim()
        .to_string()
}

fn kill(sig: &str, pid: &str) {
    assert!(Command::new("kill")
        .args([sig, pid])
        .status()
        .expect("kill")
        .success());
    let t0 = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        // a zombie of this process? it was the background parent's child: reaped by init
        if std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z ")) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{pid} did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn background_serve_and_the_restore_message_after_a_kill_9_are_true() {
    let dir = Scratch::new("restore");
    let run = dir.path("run");
    let cli = |args: &[&str]| {
        let o = Command::new(BIN)
            .arg("--run-dir")
            .arg(&run)
            .args(args)
            .output()
            .expect("cli");
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
        text(&o.stdout)
    };
    // returns once it answers: the next command finds it
    let o = serve_bg(&run, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let pid = pid_of(&run);
    assert_eq!(
        text(&o.stdout),
        format!(
            "dmkit serve: running in the background (pid {pid}); control {}, log {}\n",
            run.join("control.sock").display(),
            run.join("serve.log").display()
        )
    );
    assert_eq!(cli(&["ls"]), "No devices found\n");
    // a second one fails, and says why
    let o = serve_bg(&run, &[]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        text(&o.stderr),
        format!(
            "dmkit serve: {}: another dmkit daemon is listening there\n",
            run.join("control.sock").display()
        )
    );
    cli(&["create", "a", "--table", "0 8 zero"]);
    cli(&["create", "b", "--table", "0 16 zero"]);
    cli(&["create", "c", "--table", "0 8 linear /dev/mapper/a 0"]);
    kill("-9", &pid);

    // a plain serve sets them aside and says so in its first line, with how to
    // get them back
    let o = serve_bg(&run, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let waiting = format!(
        "3 devices of the previous daemon are waiting, not made again (recorded in {}): stop this \
         daemon and run `dmkit serve --restore` to make them again",
        run.join("devices.prev").display()
    );
    let out = text(&o.stdout);
    assert_eq!(
        out.lines().next(),
        Some(format!("dmkit serve: {waiting}").as_str()),
        "{out}"
    );
    assert_eq!(cli(&["ls"]), "No devices found\n");
    let log = std::fs::read_to_string(run.join("serve.log")).expect("log");
    assert!(log.contains(&waiting), "{log}");
    kill("-TERM", &pid_of(&run));
    // a daemon started again without --restore says it again (they still wait)
    let o = serve_bg(&run, &[]);
    let again = format!(
        "dmkit serve: 3 devices of an earlier daemon are waiting, not made again (recorded in {}): \
         stop this daemon and run `dmkit serve --restore` to make them again",
        run.join("devices.prev").display()
    );
    assert_eq!(text(&o.stdout).lines().next(), Some(again.as_str()));
    kill("-TERM", &pid_of(&run));

    // ... and that is what it does
    let o = serve_bg(&run, &["--restore"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout).lines().next(),
        Some(
            format!(
                "dmkit serve: restored 3 devices (0 attached as block devices) from {}",
                run.join("devices.state").display()
            )
            .as_str()
        )
    );
    assert_eq!(cli(&["ls"]), "a\t(511:0)\nb\t(511:1)\nc\t(511:2)\n");
    assert_eq!(cli(&["table", "c"]), "0 8 linear 511:0 0\n");
    kill("-TERM", &pid_of(&run));
    assert!(!run.join("serve.pid").exists(), "a clean exit removes serve.pid");
}

#[test]
fn a_pool_lists_its_metadata_file_as_the_kernel_does() {
    let d = Daemon::start("pooldeps");
    let meta = d.dir.sparse("meta.img", 4 << 20).display().to_string();
    let data = d.dir.sparse("data.img", 64 << 20).display().to_string();
    d.create("pool", &format!("0 131072 thin-pool {meta} {data} 128 0"));
    d.ok(&["message", "pool", "0", "create_thin 0"]);
    d.create("thin", "0 8192 thin /dev/mapper/pool 0");
    assert_eq!(
        d.ok(&["deps", "pool"]),
        format!("2 dependencies\t: ({data}) ({meta})\n")
    );
    assert_eq!(
        d.ok(&["ls", "--tree"]),
        format!("thin (511:1)\n `-pool (511:0)\n    |- ({data})\n    `- ({meta})\n")
    );
    assert_eq!(
        d.ok(&["info", "-c", "--noheadings", "-o", "devs_used", "pool"])
            .trim_end(),
        format!("{data},{meta}")
    );
    let stats = d.ok(&["stats", "thin"]);
    let files: Vec<&str> = stats.lines().map(|l| l.split(' ').next().unwrap_or("")).collect();
    assert_eq!(files, vec![meta.as_str(), data.as_str()], "{stats}");
}

#[test]
fn thin_tools_on_a_device_that_is_not_a_pool_say_so() {
    let d = Daemon::start("notpool");
    let a = d.dir.sparse("a.img", 1 << 20).display().to_string();
    d.create("lin", &format!("0 2048 linear {a} 0"));
    for tool in ["ls", "check", "dump"] {
        let o = d.cli(&["thin", tool, "/dev/mapper/lin"]);
        assert_eq!(o.status.code(), Some(64), "{tool}");
        assert_eq!(
            text(&o.stderr),
            "dev lin is a linear device, not a thin-pool\n",
            "{tool}"
        );
    }
}

#[test]
fn thin_links_are_idempotent_and_force_replaces_other_files() {
    let dir = Scratch::new("links");
    let bin = dir.path("bin");
    std::fs::create_dir_all(&bin).expect("bin");
    let links = |force: bool| {
        let mut c = Command::new(BIN);
        c.args(["thin", "links"]).arg(&bin);
        if force {
            c.arg("--force");
        }
        c.output().expect("links")
    };
    // the links lead to the lean dmkit-tools beside dmkit
    let exe = std::fs::canonicalize(TOOLS).expect("exe");
    // one left from an install whose links led to dmkit itself: moved, no --force
    std::os::unix::fs::symlink(BIN, bin.join("cache_dump")).expect("old link");
    let first = links(false);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(text(&first.stdout).contains(&format!("{}/thin_check -> ", bin.display())));
    // the era tools' names too
    assert!(text(&first.stdout).contains(&format!("{}/era_invalidate -> ", bin.display())));
    let again = links(false);
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(
        text(&again.stdout).contains(" (already)\n"),
        "{}",
        text(&again.stdout)
    );
    assert_eq!(std::fs::canonicalize(bin.join("thin_check")).expect("link"), exe);
    assert_eq!(std::fs::canonicalize(bin.join("cache_dump")).expect("link"), exe);
    // another file of a tool's name: refused, nothing touched, until --force
    std::fs::remove_file(bin.join("thin_dump")).expect("rm");
    std::fs::write(bin.join("thin_dump"), "#!/bin/sh\n").expect("other tool");
    let o = links(false);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        text(&o.stderr),
        format!(
            "dmkit thin links: {}/thin_dump is a file, not this dmkit: nothing linked (--force replaces it)\n",
            bin.display()
        )
    );
    assert_eq!(
        std::fs::read_to_string(bin.join("thin_dump")).expect("kept"),
        "#!/bin/sh\n"
    );
    let o = links(true);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(std::fs::canonicalize(bin.join("thin_dump")).expect("link"), exe);
}

#[test]
fn the_tools_binary_runs_the_tools_without_openssl() {
    // what the dynamic linker loads for every tool run: no OpenSSL (the
    // daemon's NBD TLS is not in it), which dmkit itself needs
    let needs = |bin: &str| {
        let o = Command::new("ldd").arg(bin).output().expect("ldd");
        assert!(o.status.success(), "{}", text(&o.stderr));
        text(&o.stdout).contains("libssl")
    };
    assert!(needs(BIN));
    assert!(!needs(TOOLS));
    // by a tool's name, or with the family's word, as dmkit runs them
    let dir = Scratch::new("tools-bin");
    let link = dir.path("cache_metadata_size");
    std::os::unix::fs::symlink(TOOLS, &link).expect("link");
    for mut c in [
        Command::new(&link),
        {
            let mut c = Command::new(TOOLS);
            c.args(["cache", "metadata_size"]);
            c
        },
        {
            let mut c = Command::new(BIN);
            c.args(["cache", "metadata_size"]);
            c
        },
    ] {
        let o = c.args(["--nr-blocks", "1000000"]).output().expect("run");
        assert_eq!(
            (o.status.code(), text(&o.stdout), text(&o.stderr)),
            (Some(0), "62879.50 sectors\n".to_string(), String::new())
        );
    }
    let o = Command::new(TOOLS).arg("serve").output().expect("run");
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(text(&o.stdout), "");
    assert_eq!(
        text(&o.stderr),
        "dmkit-tools: run it by a tool's name (thin_check, era_dump, cache_restore, ...: `dmkit thin \
         links DIR` makes them), or as `dmkit-tools thin|era|cache VERB ...`\n"
    );
}

#[test]
fn every_verb_has_help_with_an_example() {
    let top = text(&dmkit(&["--help"]).stdout);
    let verbs: Vec<&str> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(verbs.len() > 20, "{top}");
    for v in &verbs {
        if [
            "thin",
            "era",
            "cache",
            "completions",
            "extents",
            "progress",
            "sim",
        ]
        .contains(v)
        {
            continue; // dmkit's own, with help of their own
        }
        let h = text(&dmkit(&[v, "--help"]).stdout);
        assert!(h.contains("Example"), "dmkit {v} --help has no example:\n{h}");
    }
    let create = text(&dmkit(&["create", "--help"]).stdout);
    assert!(
        create.contains("512-byte sectors") && create.contains("`dmkit targets`"),
        "{create}"
    );
    let load = text(&dmkit(&["load", "--help"]).stdout);
    assert!(!load.contains("--notable"), "{load}");
    let message = text(&dmkit(&["message", "--help"]).stdout);
    assert!(
        message.contains("<SECTOR>") && message.contains("dmkit message pool 0 \"create_thin 0\""),
        "{message}"
    );
}

/// `serve --attach` makes every device a ublk block device: where ublk cannot be
/// used it fails at start with what to do, rather than start and make no block
/// device without a word.
#[test]
fn serve_attach_without_ublk_fails_at_start() {
    let dir = Scratch::new("attachnoublk");
    let run = dir.path("run");
    let o = serve_bg(&run, &["--attach"]);
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/ublk-control")
    {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            assert_eq!(o.status.code(), Some(1));
            assert_eq!(
                text(&o.stderr),
                "dmkit serve: serve --attach: ublk is not available: /dev/ublk-control does not exist \
                 (load the driver with `modprobe ublk_drv`; Linux 6.5 or later)\n"
            );
        }
        Err(e) => panic!("/dev/ublk-control: {e}"),
        Ok(_) => {
            assert!(o.status.success(), "{}", text(&o.stderr));
            kill("-TERM", &pid_of(&run));
        }
    }
}

/// Every refused name and length says which rule it broke and the limit.
#[test]
fn refusals_name_the_rule_and_the_limit() {
    let d = Daemon::start("rules");
    let long = "n".repeat(128);
    for (name, why) in [
        (
            "control",
            "\"control\", \".\" and \"..\" are reserved (the control node, and the directory's own entries)",
        ),
        (
            "..",
            "\"control\", \".\" and \"..\" are reserved (the control node, and the directory's own entries)",
        ),
        ("a/b", "a name cannot contain '/'"),
        (long.as_str(), "a name is at most 127 bytes, and this one is 128"),
    ] {
        let e = d.fails(&["create", name, "--table", "0 8 zero"]);
        assert!(
            e.contains("invalid device name '") && e.trim_end().ends_with(why),
            "{name}: {e}"
        );
    }
    let e = d.fails(&["create", "big", "--table", "0 9223372036854775808 zero"]);
    assert!(
        e.contains("target too large: it would end at sector 9223372036854775808, past the largest device (18014398509481983 sectors, 2^54 - 1)"),
        "{e}"
    );
    // remove --force says what it did to a device still open
    let back = d.dir.sparse("back", 1 << 20);
    d.create("held", &format!("0 2048 linear {} 0", back.display()));
    let dmkit = format!("{} --run-dir {}", BIN, d.run.display());
    let o = d
        .exec()
        .args([
            "bash",
            "-c",
            &format!("exec 3<>/dev/mapper/held; {dmkit} remove --force held"),
        ])
        .output()
        .expect("bash");
    assert_eq!(
        text(&o.stderr),
        "dmkit remove: held: Device or resource busy: open count 1; --force replaced its table with an \
         error target, so its I/O fails until it is closed and removed\n"
    );
    assert_eq!(d.ok(&["table", "held"]), "0 2048 error \n");
}

/// `dmkit sim`'s summary adds up: passed and failed make the trials, and the
/// crash points of the passed ones make the passed.
#[test]
fn the_simulators_summary_adds_up() {
    let o = dmkit(&["sim", "--stack", "thin", "--trials", "6", "--ops", "40"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let num = |after: &str| -> u64 {
        let i = out.find(after).unwrap_or_else(|| panic!("no '{after}' in {out}"));
        let before = out[..i].trim_end();
        before
            .rsplit(' ')
            .next()
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("{after}: {out}"))
    };
    let (trials, passed, failed) = (num(" trials of thin"), num(" passed"), num(" failed"));
    let (a, b, c) = (
        num(" times at a flush inside a commit"),
        num(" after a chosen write"),
        num(" after the last operation"),
    );
    assert_eq!((trials, passed + failed, a + b + c), (6, 6, passed), "{out}");
}

/// On a machine where the fresh clone's target directory does not exist yet (every
/// CI run), copies into it the dependencies the suite's own release build compiled,
/// with their fingerprints and build-script outputs, so that the clone's build
/// compiles dmkit and what differs (cargo rebuilds whatever does not match), not
/// every dependency again beside the other tests (about 9 CPU-minutes of the
/// suite's own build, by `cargo nextest run --release --no-run --timings`).
fn seed_with_the_suites_dependencies(target: &Path) {
    let release = target.join("release");
    if release.exists() {
        return;
    }
    // this test's binary is PROFILE/deps/first_hour-HASH
    let exe = std::env::current_exe().expect("the test's own path");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("the suite's profile directory");
    std::fs::create_dir_all(&release).expect("the fresh clone's target directory");
    // cp -a keeps the times cargo compares; dmkit's own units are left out (the
    // clone's path makes them other units)
    common::run(
        Command::new("sh")
            .args([
                "-c",
                r#"set -e
                for d in deps build .fingerprint; do
                    mkdir -p "$2/$d"
                    find "$1/$d" -mindepth 1 -maxdepth 1 ! -name '*dmkit*' \
                        \( -name 'lib*' -o ! -path '*/deps/*' \) -exec cp -a -t "$2/$d" {} +
                done"#,
                "seed",
            ])
            .arg(profile)
            .arg(&release),
    );
}

/// The README's two commands, exactly as written, in a fresh clone of the
/// repository: the demo command until it prints its URIs (and, run again, says
/// it reopened the pool), and the test command's own first steps (its
/// installer, fmt and the module check; the CI run itself is the rest).
#[test]
fn the_readmes_two_commands_work_in_a_fresh_clone() {
    common::need_all(&["git", "cargo"]);
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).expect("README");
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("The two commands"))
        .expect("a section 'The two commands'");
    let commands: Vec<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("    "))
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(commands, ["cargo run --release -- serve --demo", "./ci/test.sh"]);
    let dir = Scratch::new("freshclone");
    let clone = dir.path("clone");
    let repo = env!("CARGO_MANIFEST_DIR");
    let is_git = Command::new("git")
        .args(["-C", repo, "rev-parse", "--is-inside-work-tree"])
        .output()
        .is_ok_and(|o| o.status.success());
    if is_git {
        common::run(Command::new("git").args(["clone", "--quiet", repo]).arg(&clone));
    } else {
        // a checkout without its git history: the tree as it is, without builds
        std::fs::create_dir_all(&clone).expect("clone dir");
        common::run(Command::new("sh").arg("-c").arg(format!(
            "tar -C '{repo}' --exclude=./target --exclude=./dmkit-demo -cf - . | tar -C '{}' -xf -",
            clone.display()
        )));
    }
    // its own target directory: the suite's is locked by the cargo running it;
    // kept between runs (only the dmkit crate builds again in a warm one)
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fresh-clone");
    seed_with_the_suites_dependencies(&target);
    let demo = |tag: &str| -> String {
        let mut child = Command::new("sh")
            .args(["-c", commands[0]])
            .current_dir(&clone)
            .env("CARGO_TARGET_DIR", &target)
            .env("DMKIT_RUN_DIR", dir.path("run"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("the demo command");
        let mut out = child.stdout.take().expect("stdout");
        let mut seen = String::new();
        let t0 = Instant::now();
        let mut buf = [0u8; 4096];
        use std::io::Read;
        while !seen.contains("demo-zero?socket=") {
            assert!(t0.elapsed() < Duration::from_secs(1800), "{tag}: no URIs: {seen}");
            match out.read(&mut buf) {
                Ok(0) | Err(_) => panic!("{tag}: the demo ended before its URIs: {seen}"),
                Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
        // Ctrl-C stops it: the daemon (cargo's child) gets SIGINT, cargo exits with it
        let _ = Command::new("pkill")
            .args(["-INT", "-f", "target/fresh-clone/release/dmkit serve --demo"])
            .status();
        let status = child.wait().expect("wait");
        assert!(status.success(), "{tag}: the demo exited {status}");
        seen
    };
    let first = demo("first run");
    assert!(
        first.contains("dmkit demo: a thin pool over sparse files in "),
        "{first}"
    );
    for name in ["demo-thin", "demo-snap", "demo-zero"] {
        assert!(first.contains(&format!("nbd+unix:///{name}?socket=")), "{first}");
    }
    let second = demo("second run");
    assert!(
        second.contains("dmkit demo: reopened the thin pool of an earlier demo in "),
        "{second}"
    );
    // the test command's first steps
    common::run(
        Command::new("bash")
            .args([
                "-c",
                "ci/install.sh && cargo fmt --all -- --check && python3 ci/modules.py",
            ])
            .current_dir(&clone),
    );
}
