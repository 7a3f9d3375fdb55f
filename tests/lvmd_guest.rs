//! `dmkit lvmd` making kernel block devices (issue 49): in the oracle's 6.12
//! guest (ublk_drv loaded), lvmd without `--no-attach` answers each CreateLV and
//! CreateLVSnapshot with the ublk device it attached, and TopoLVM's sequence on a
//! node — make a filesystem on the volume, mount it, snapshot it, resize it,
//! remove both — works on those devices.
//!
//! The client is tests/lvmd/client.py on the host (grpcio, generated from proto/):
//! lvmd's socket in the guest is bridged by socat to a virtio-serial port, whose
//! QEMU end connects to a host unix socket of the test before the guest boots (so
//! nothing the guest writes is dropped for want of a peer), and the test copies
//! the bytes between it and the client's connection. The steps are paced by a
//! mailbox disk.
//!
//! Asserted: each answer's path is a /dev/ublkbN whose major:minor in the guest
//! are the answer's; the volume's filesystem and a file on it; RemoveLV and
//! ResizeLV refused while the volume is mounted (INTERNAL as lvmd's lvremove
//! failure, FAILED_PRECONDITION: a ublk device cannot change size under a mount),
//! its record and device untouched; the read-only snapshot's block device is
//! read-only and holds the file as it was (the volume frozen for it, as a backup
//! does); a resize of the unmounted volume
//! attaches it again at the new size, and resize2fs grows its filesystem with the
//! file intact; a lvmd killed and started again lists both volumes with the same
//! block devices, numbers, sizes and attributes; RemoveLV of both leaves no block device, no dmkit device but the
//! pool, and no volume in GetLVList; lvmd and the daemon logged no error.

use crate::common;
use crate::lvmd::Client;
use crate::oracle;
use common::{tool_path, Scratch, BIN, MIB};
use oracle::{post, wait_for, DMKIT_GUEST, EXT4_UBLK_MODULES};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};

/// The guest's `major:minor` of `/dev/ublkbN`, as the answer has them.
fn numbers(v: &Value) -> String {
    format!("{}:{}", v["dev_major"], v["dev_minor"])
}

/// QEMU's end of the port connects to `qemu`, the gRPC clients to `client`, one
/// after another; the bytes go both ways between QEMU's connection and the
/// client's of the moment. What the guest sends while no client is connected
/// (lvmd's first frame, sent as soon as the guest bridges) waits for the next.
fn bridge(qemu: UnixListener, client: UnixListener) {
    use std::sync::{Arc, Mutex};
    // the client of the moment, and what waits for one
    let now: Arc<Mutex<(Option<UnixStream>, Vec<u8>)>> = Arc::default();
    let to_client = now.clone();
    std::thread::spawn(move || {
        let (q, _) = qemu.accept().expect("QEMU's chardev connects");
        let from_guest = q.try_clone().expect("clone");
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n @ 1..) = (&from_guest).read(&mut buf) {
                let mut st = to_client.lock().unwrap();
                let sent = st.0.as_mut().is_some_and(|c| c.write_all(&buf[..n]).is_ok());
                if !sent {
                    st.0 = None;
                    st.1.extend_from_slice(&buf[..n]);
                }
            }
        });
        for c in client.incoming() {
            let mut c = c.expect("a client connects");
            {
                let mut st = now.lock().unwrap();
                let waiting = std::mem::take(&mut st.1);
                c.write_all(&waiting).expect("to the client");
                st.0 = Some(c.try_clone().expect("clone"));
            }
            let _ = std::io::copy(&mut &c, &mut &q);
            now.lock().unwrap().0 = None;
        }
    });
}

/// Volume `name` as GetLVList lists it.
fn listed(c: &mut Client, name: &str) -> Value {
    let l = c.ok("vg", "GetLVList", json!({"device_class": "thin"}));
    l["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("{name} not listed: {l}"))
}

#[test]
fn lvmd_attaches_volumes_and_snapshots_as_ublk_devices_in_a_guest() {
    let s = Scratch::new("lvmd-guest");
    let meta = s.sparse("meta.img", 16 * MIB);
    let data = s.sparse("data.img", 512 * MIB);
    let mailbox = s.sparse("mailbox.img", MIB);
    let port = s.path("lvmd-port.sock");
    let serial = s.path("serial.txt");
    let bins = [
        BIN.to_string(),
        tool_path("mke2fs"),
        tool_path("e2fsck"),
        tool_path("resize2fs"),
        tool_path("socat"),
    ]
    .join(" ");
    let data_sectors = 512 * MIB / 512;
    let script = format!(
        r#"
set -e
{DMKIT_GUEST}
mb() {{ dd if=/dev/vdc bs=512 count=1 iflag=direct 2>/dev/null | head -c 4; }}
wait_mb() {{ while [ "$(mb)" != "$1" ]; do sleep 0.2; done; }}
node() {{ b=$(basename $(readlink -f /dev/mapper/$1)); echo "/dev/$b $(cat /sys/block/$b/dev) ro=$(cat /sys/block/$b/ro) size=$(cat /sys/block/$b/size)"; }}
start
$D create pool --table "0 {data_sectors} thin-pool /dev/vda /dev/vdb 128 0"
cat > /tmp/lvmd.yaml <<EOF
socket-name: /run/lvmd.sock
device-classes:
  - name: thin
    default: true
    spare-gb: 0
    type: thin
    thin-pool:
      name: pool
      overprovision-ratio: 10.0
EOF
lvmd() {{
  rm -f /run/lvmd.sock
  dmkit lvmd --run-dir /run/dmkit --config /tmp/lvmd.yaml --state /tmp/lvmd.d >> /tmp/lvmd.log 2>&1 &
  echo $! > /tmp/lvmd.pid
  i=0; while [ ! -S /run/lvmd.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
}}
lvmd
PORT=
for p in /sys/class/virtio-ports/*; do [ "$(cat $p/name)" = lvmd ] && PORT=/dev/$(basename $p); done
echo "ORACLE lvmd-up socket=$(test -S /run/lvmd.sock && echo y) port=${{PORT:+y}}"
socat GOPEN:$PORT UNIX-CONNECT:/run/lvmd.sock 2>>/tmp/socat.log &
echo $! > /tmp/socat.pid
echo "ORACLE bridged yes"

wait_mb "made"
echo "ORACLE vol $(node vol)"
mkfs.ext4 -q /dev/mapper/vol
mkdir -p /mnt/vol /mnt/snap
mount -t ext4 /dev/mapper/vol /mnt/vol
dd if=/dev/urandom of=/mnt/vol/f bs=64k count=128 2>/dev/null
sync
# the filesystem frozen (its journal written out) for the snapshot, as a backup does
fsfreeze --freeze /mnt/vol
echo "ORACLE written $(md5sum < /mnt/vol/f | cut -d' ' -f1)"

wait_mb "snap"
fsfreeze --unfreeze /mnt/vol
echo "ORACLE snap $(node snap)"
mount -t ext4 -o ro /dev/mapper/snap /mnt/snap
echo "ORACLE snap-file $(md5sum < /mnt/snap/f | cut -d' ' -f1)"
dd if=/dev/zero of=/dev/mapper/snap bs=4k count=1 oflag=direct 2>/dev/null && echo "ORACLE snap-write taken" || echo "ORACLE snap-write refused"
umount /mnt/snap
umount /mnt/vol
echo "ORACLE unmounted"

wait_mb "rsz."
echo "ORACLE resized $(node vol)"
e2fsck -fy /dev/mapper/vol > /tmp/fsck 2>&1 || true
resize2fs /dev/mapper/vol > /tmp/resize 2>&1 && echo "ORACLE resize2fs ok" || {{ echo "ORACLE resize2fs failed"; cat /tmp/resize; }}
mount -t ext4 /dev/mapper/vol /mnt/vol
echo "ORACLE fs-blocks $(df -k /mnt/vol | tail -1 | tr -s ' ' | cut -d' ' -f2)"
echo "ORACLE after-resize $(md5sum < /mnt/vol/f | cut -d' ' -f1)"
umount /mnt/vol
echo "ORACLE unmounted-again"

# lvmd killed and started again (its pod restarted): it finds its volumes attached
wait_mb "rst."
kill -9 $(cat /tmp/lvmd.pid) $(cat /tmp/socat.pid)
lvmd
socat GOPEN:$PORT UNIX-CONNECT:/run/lvmd.sock 2>>/tmp/socat.log &
echo "ORACLE restarted $(test -S /run/lvmd.sock && echo y)"

wait_mb "rm.."
echo "ORACLE ublk-left $(ls /sys/block | grep -c ublkb || true)"
echo "ORACLE devices $($D ls | awk '{{printf "%s ", $1}}')"
grep -i "error\|panic" /tmp/lvmd.log /tmp/dmkit.log | head -5 || :
echo "ORACLE lvmd-errors $(grep -ci "error\|panic" /tmp/lvmd.log || true)"
echo "ORACLE log-errors $(grep -c "ERROR\|panic" /tmp/dmkit.log || true)"
"#
    );
    let qemu = format!(
        "-device virtio-serial-pci -chardev socket,id=lvmd,path={},server=off \
         -device virtserialport,chardev=lvmd,name=lvmd",
        port.display()
    );
    let grpc = s.path("lvmd.sock");
    bridge(
        UnixListener::bind(&port).expect("bind the port's socket"),
        UnixListener::bind(&grpc).expect("bind the client's socket"),
    );
    let guest = {
        let dir = s.0.clone();
        let disks = [meta.clone(), data.clone(), mailbox.clone()];
        let serial = serial.display().to_string();
        std::thread::spawn(move || {
            let paths: Vec<&std::path::Path> = disks.iter().map(|p| p.as_path()).collect();
            oracle::run_env(
                &dir,
                &script,
                &paths,
                &[
                    ("ORACLE_BINS", &bins),
                    ("ORACLE_MODULES", EXT4_UBLK_MODULES),
                    ("DMKIT_ORACLE_KERNEL", "6.12"),
                    ("ORACLE_QEMU_ARGS", &qemu),
                    ("ORACLE_SERIAL", &serial),
                    ("DMKIT_ORACLE_TIMEOUT", "900"),
                ],
            )
        })
    };

    /// On a failure, what the guest printed so far.
    struct Console(std::path::PathBuf);
    impl Drop for Console {
        fn drop(&mut self) {
            if std::thread::panicking() {
                let s = std::fs::read_to_string(&self.0).unwrap_or_default();
                eprintln!("--- guest serial so far ---\n{s}--- end ---");
            }
        }
    }
    let _console = Console(serial.clone());
    wait_for(&serial, "ORACLE lvmd-up");
    let mut c = Client::spawn(&grpc, None);
    c.send(&json!({"ready": 300}));
    c.answer().expect("the client reached lvmd in the guest");

    let vol = c.ok(
        "lv",
        "CreateLV",
        json!({"name": "vol", "size_bytes": 64 * MIB, "device_class": "thin"}),
    )["volume"]
        .clone();
    post(&mailbox, "made");
    wait_for(&serial, "ORACLE written");

    // in use: neither removed nor resized, and nothing about them changed
    let m = c.fails(
        "lv",
        "RemoveLV",
        json!({"name": "vol", "device_class": "thin"}),
        "INTERNAL",
    );
    assert!(m.contains("in use") && m.contains("/dev/ublkb"), "{m}");
    let m = c.fails(
        "lv",
        "ResizeLV",
        json!({"name": "vol", "size_bytes": 128 * MIB, "device_class": "thin"}),
        "FAILED_PRECONDITION",
    );
    assert!(m.contains("mounted or held") && m.contains("unmount it"), "{m}");
    assert_eq!(listed(&mut c, "vol"), vol, "the refusals changed the volume");
    let snap = c.ok(
        "lv",
        "CreateLVSnapshot",
        json!({"name": "snap", "source_volume": "vol", "access_type": "ro", "device_class": "thin"}),
    )["snapshot"]
        .clone();
    post(&mailbox, "snap");
    wait_for(&serial, "ORACLE unmounted");

    let grown = c.ok(
        "lv",
        "ResizeLV",
        json!({"name": "vol", "size_bytes": 128 * MIB, "device_class": "thin"}),
    );
    assert_eq!(grown["size_bytes"], json!(128 * MIB), "{grown}");
    let vol2 = listed(&mut c, "vol");
    post(&mailbox, "rsz.");
    wait_for(&serial, "ORACLE unmounted-again");

    // a new lvmd (after a kill -9) and a new client: the same volumes, attached
    drop(c);
    post(&mailbox, "rst.");
    wait_for(&serial, "ORACLE restarted");
    let mut c = Client::spawn(&grpc, None);
    c.send(&json!({"ready": 300}));
    c.answer().expect("the client reached the new lvmd");
    for (n, before) in [("vol", &vol2), ("snap", &snap)] {
        let now = listed(&mut c, n);
        for k in ["path", "dev_major", "dev_minor", "size_bytes", "attr"] {
            assert_eq!(now[k], before[k], "{n}'s {k} after lvmd's restart");
        }
    }

    c.ok("lv", "RemoveLV", json!({"name": "snap", "device_class": "thin"}));
    c.ok("lv", "RemoveLV", json!({"name": "vol", "device_class": "thin"}));
    assert!(c.names().is_empty(), "volumes left");
    post(&mailbox, "rm..");
    drop(c);

    let out = guest.join().expect("guest thread");
    let marks = oracle::markers(&out);
    let get = |k: &str| oracle::marker(&marks, k).to_string();
    assert_eq!(get("lvmd-up"), "socket=y port=y");
    assert_eq!(get("bridged"), "yes");
    assert_eq!(get("restarted"), "y");

    // the answers name the guest's block devices
    for (name, v, key, ro, sectors) in [
        ("vol", &vol, "vol", 0, 64 * MIB / 512),
        ("snap", &snap, "snap", 1, 64 * MIB / 512),
        ("vol", &vol2, "resized", 0, 128 * MIB / 512),
    ] {
        let seen = get(key);
        let path = v["path"].as_str().unwrap_or_default();
        assert!(path.starts_with("/dev/ublkb"), "{name}: {v}");
        assert_eq!(
            seen,
            format!("{path} {} ro={ro} size={sectors}", numbers(v)),
            "{name}: the guest's node against the answer {v}"
        );
    }
    assert_eq!(vol["size_bytes"], json!(64 * MIB));
    assert_eq!(snap["attr"], json!("Vri-a-tz--"), "{snap}");

    let written = get("written");
    assert_eq!(written.len(), 32, "{written}");
    assert_eq!(get("snap-file"), written, "the snapshot holds the file");
    assert_eq!(get("snap-write"), "refused", "a read-only snapshot took a write");
    assert_eq!(get("resize2fs"), "ok");
    let fs_kib: u64 = get("fs-blocks").parse().expect("df");
    assert!(fs_kib > 100 * 1024, "the filesystem grew: {fs_kib} KiB");
    assert_eq!(get("after-resize"), written, "the file after the resize");
    assert_eq!(get("ublk-left"), "0");
    assert_eq!(get("devices"), "pool");
    assert_eq!(get("lvmd-errors"), "0");
    assert_eq!(get("log-errors"), "0");
}
