//! Kernel oracle for dm-crypt (one boot of Debian's Linux 6.12 under qemu,
//! tests/oracle/run.sh, with dm-crypt and the crypto modules it uses loaded):
//! images that dmkit's `crypt` wrote read the same plaintext through the
//! kernel's dm-crypt with the same table, images the kernel wrote read the same
//! through dmkit, and both print the same table line.

use crate::common;
use crate::oracle;

use common::nbd::Client;
use common::{image, pattern, Daemon, Scratch};
use oracle::{marker, markers, md5, GUEST_HELPERS};
use std::path::Path;

use common::MIB;
const SIZE: u64 = 4 * MIB;

/// What the guest loads for dm-crypt, in dependency order (paths under the
/// 6.12 kernel's modules; cbc, ecb, aes and sha256 are built in).
const MODULES: &str = "lib/crypto/gf128mul.ko crypto/xts.ko crypto/authenc.ko crypto/essiv.ko \
                       crypto/cryptd.ko crypto/crypto_simd.ko arch/x86/crypto/aesni-intel.ko \
                       drivers/md/dm-crypt.ko";

/// (name, table after the device's length with `DEV` for the device, sectors).
struct Case {
    name: &'static str,
    table: String,
    sectors: u64,
}

fn case(name: &'static str, cipher: &str, key_bytes: usize, rest: &str, offset: u64) -> Case {
    let key: String = (0..key_bytes)
        .map(|i| format!("{:02x}", (i * 37 + usize::from(name.as_bytes()[0]) * 11) as u8))
        .collect();
    let (iv_offset, opts) = rest.split_once(' ').unwrap_or((rest, ""));
    let opts = if opts.is_empty() {
        String::new()
    } else {
        format!(" {opts}")
    };
    Case {
        name,
        table: format!("{cipher} {key} {iv_offset} DEV {offset}{opts}"),
        sectors: SIZE / 512 - offset,
    }
}

fn table(c: &Case, dev: &str) -> String {
    format!("0 {} crypt {}", c.sectors, c.table.replace("DEV", dev))
}

/// The table line without its device field (the kernel prints major:minor).
fn without_device(line: &str) -> Vec<String> {
    let mut f: Vec<String> = line.split_whitespace().map(str::to_string).collect();
    if f.len() > 6 {
        f.remove(6);
    }
    f
}

#[test]
fn dmkit_and_the_kernels_dm_crypt_read_each_others_images() {
    let s = Scratch::new("crypt-oracle");
    // dmkit writes these, the kernel reads them
    let ours = [
        case("a", "aes-xts-plain64", 64, "40", 8),
        case(
            "b",
            "capi:cbc(aes)-essiv:sha256",
            32,
            "64 2 sector_size:4096 iv_large_sectors",
            0,
        ),
    ];
    // the kernel writes these, dmkit reads them
    let theirs = [
        case("c", "aes-xts-plain64", 64, "24", 0),
        case(
            "d",
            "aes-cbc-essiv:sha256",
            16,
            "40 2 allow_discards sector_size:4096",
            0,
        ),
        case("e", "aes-xts-plain64be", 32, "16 1 iv_large_sectors", 0),
        case("f", "capi:xts(aes)-plain", 48, "7", 0),
    ];
    let mut imgs = Vec::new();
    let mut want = Vec::new();
    {
        let d = Daemon::start("crypt-oracle-w");
        for (i, c) in ours.iter().enumerate() {
            let img = image(&s, &format!("{}.img", c.name), SIZE, None);
            d.create(c.name, &table(c, &img.display().to_string()));
            let mut cl = Client::connect(&d.sock(), c.name);
            let data = pattern(40 + i as u64, (c.sectors * 512) as usize);
            for (j, chunk) in data.chunks(256 << 10).enumerate() {
                cl.write((j * (256 << 10)) as u64, chunk);
            }
            assert!(cl.read(0, data.len()) == data, "{}: dmkit reads back", c.name);
            want.push(md5(&data));
            imgs.push(img);
        }
    }
    for c in &theirs {
        imgs.push(image(&s, &format!("{}.img", c.name), SIZE, Some(9)));
    }

    let mut script = String::from(GUEST_HELPERS);
    let devs = ["vda", "vdb", "vdc", "vdd", "vde", "vdf"];
    for (c, dev) in ours.iter().chain(&theirs).zip(devs) {
        let n = c.name;
        script += &format!("mk k{n} \"{}\"\n", table(c, &format!("/dev/{dev}")));
        script += &format!("echo \"ORACLE {n}-table $(dmsetup table --showkeys k{n})\"\n");
    }
    for c in &ours {
        let n = c.name;
        script += &format!("echo \"ORACLE {n}-md5 $(sum /dev/mapper/k{n})\"\n");
    }
    for c in &theirs {
        let n = c.name;
        script += &format!(
            "dd if=/dev/urandom of=/dev/mapper/k{n} bs=65536 count={} 2>/dev/null\nsync\n\
             echo \"ORACLE {n}-md5 $(sum /dev/mapper/k{n})\"\n",
            c.sectors * 512 / 65536
        );
    }
    for c in ours.iter().chain(&theirs) {
        script += &format!("dmsetup remove k{}\n", c.name);
    }
    script += "echo \"ORACLE done yes\"\n";
    let disks: Vec<&Path> = imgs.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(
        &s.0,
        &script,
        &disks,
        &[("ORACLE_MODULES", MODULES), ("DMKIT_ORACLE_KERNEL", "6.12")],
    );
    let m = markers(&serial);
    assert_eq!(marker(&m, "done"), "yes");
    for (c, w) in ours.iter().zip(&want) {
        assert_eq!(
            marker(&m, &format!("{}-md5", c.name)),
            w,
            "{}: the kernel reads dmkit's image as the plaintext dmkit wrote ({})",
            c.name,
            c.table
        );
    }
    let d = Daemon::start("crypt-oracle-r");
    for (c, img) in ours.iter().chain(&theirs).zip(&imgs) {
        d.create(c.name, &table(c, &img.display().to_string()));
        let kernel = marker(&m, &format!("{}-table", c.name));
        let mine = d.ok(&["table", "--showkeys", c.name]);
        assert_eq!(
            without_device(&mine),
            without_device(kernel),
            "{}: the table lines differ (device aside)",
            c.name
        );
    }
    for c in &theirs {
        let mut cl = Client::connect(&d.sock(), c.name);
        let got = cl.read(0, (c.sectors * 512) as usize);
        assert_eq!(
            md5(&got),
            marker(&m, &format!("{}-md5", c.name)),
            "{}: dmkit reads the kernel's image as the plaintext the kernel wrote ({})",
            c.name,
            c.table
        );
    }
}

/// A LUKS2 image formatted by cryptsetup here; the table that opens its data
/// (`dmkit luks table`, from the header and the passphrase), with `DEV` for
/// the device.
fn luks_image(s: &Scratch, name: &str, pw: &Path) -> (std::path::PathBuf, String, u64) {
    common::need("cryptsetup");
    let img = s.sparse(name, 32 * MIB);
    let cs = common::tool_path("cryptsetup");
    common::run(
        std::process::Command::new(&cs)
            .args([
                "luksFormat",
                "--batch-mode",
                "--type",
                "luks2",
                "--pbkdf",
                "pbkdf2",
            ])
            .args(["--pbkdf-force-iterations", "1000", "--key-file"])
            .arg(pw)
            .arg(&img),
    );
    let line = common::run(
        std::process::Command::new(common::BIN)
            .args(["luks", "table", "--key-file"])
            .arg(pw)
            .arg(&img),
    );
    let table = line
        .strip_suffix('\n')
        .expect("one line")
        .replace(&format!(" {} ", img.display()), " DEV ");
    let sectors: u64 = table
        .split(' ')
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("the table's length");
    (img, table, sectors)
}

#[test]
fn luks2_images_that_cryptsetup_formats_open_in_dmkit_and_in_the_kernel() {
    let s = Scratch::new("crypt-luks");
    let pw = s.path("pw");
    std::fs::write(&pw, "correct horse").expect("passphrase");
    // dmkit writes L1, which the guest opens with cryptsetup; the guest writes L2
    let (l1, t1, n1) = luks_image(&s, "l1.img", &pw);
    let (l2, t2, n2) = luks_image(&s, "l2.img", &pw);
    let data = pattern(77, (n1 * 512) as usize);
    {
        let d = Daemon::start("crypt-luks-w");
        d.create("l1", &t1.replace("DEV", &l1.display().to_string()));
        let mut c = Client::connect(&d.sock(), "l1");
        for (j, chunk) in data.chunks(256 << 10).enumerate() {
            c.write((j * (256 << 10)) as u64, chunk);
        }
    }
    let script = format!(
        r#"{GUEST_HELPERS}
mkdir -p /run/cryptsetup
printf 'correct horse' > /tmp/pw
for n in 1 2; do
  dev=/dev/vda; [ $n = 2 ] && dev=/dev/vdb
  cryptsetup open --type luks2 --disable-keyring --key-file /tmp/pw $dev l$n
  echo "ORACLE l$n-table $(dmsetup table --showkeys l$n)"
done
echo "ORACLE l1-md5 $(sum /dev/mapper/l1)"
dd if=/dev/urandom of=/dev/mapper/l2 bs=65536 count={} 2>/dev/null
sync
echo "ORACLE l2-md5 $(sum /dev/mapper/l2)"
cryptsetup close l1
cryptsetup close l2
echo "ORACLE done yes"
"#,
        n2 * 512 / 65536
    );
    let cs = common::tool_path("cryptsetup");
    let serial = oracle::run_env(
        &s.0,
        &script,
        &[&l1, &l2],
        &[
            ("ORACLE_MODULES", MODULES),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("ORACLE_BINS", cs.as_str()),
        ],
    );
    let m = markers(&serial);
    assert_eq!(marker(&m, "done"), "yes");
    // cryptsetup asked the kernel for the table dmkit was given
    assert_eq!(
        without_device(marker(&m, "l1-table")),
        without_device(&t1),
        "cryptsetup's table"
    );
    assert_eq!(
        without_device(marker(&m, "l2-table")),
        without_device(&t2),
        "cryptsetup's table"
    );
    assert_eq!(
        marker(&m, "l1-md5"),
        md5(&data),
        "the guest reads what dmkit wrote into LUKS2"
    );
    let d = Daemon::start("crypt-luks-r");
    d.create("l2", &t2.replace("DEV", &l2.display().to_string()));
    let got = Client::connect(&d.sock(), "l2").read(0, (n2 * 512) as usize);
    assert_eq!(
        md5(&got),
        marker(&m, "l2-md5"),
        "dmkit reads what the kernel wrote through cryptsetup"
    );
}

/// LUKS2 volumes with `--integrity hmac-sha256` (dm-crypt's AEAD over
/// dm-integrity holding its tags), the IV derived from the sector (`plain64`,
/// 32-byte tags) or random and kept in the tag (`aes-xts-random`, 48 bytes):
/// the two dmkit formats and writes (cryptsetup through the door) open in the
/// kernel with the same plaintext, the two the kernel formats and fills open
/// in dmkit with the same plaintext, and cryptsetup loads the same two table
/// lines in both (devices aside).
#[test]
fn luks2_integrity_volumes_open_in_dmkit_and_in_the_kernel() {
    let s = Scratch::new("crypt-aead");
    let pw = s.path("pw");
    std::fs::write(&pw, "correct horse").expect("passphrase");
    let p = pw.to_str().expect("utf-8");
    let imgs: Vec<std::path::PathBuf> = (1..=4)
        .map(|i| s.sparse(&format!("a{i}.img"), 32 * MIB))
        .collect();
    let ciphers = [
        "aes-xts-plain64",
        "aes-xts-random",
        "aes-xts-plain64",
        "aes-xts-random",
    ];
    let key = ["--disable-keyring", "--key-file", p];
    let cs = |d: &Daemon, args: &[&str]| d.door_ok("cryptsetup", args);
    let mut want = Vec::new();
    {
        let d = Daemon::start("crypt-aead-w");
        for n in 0..2 {
            let (img, name) = (imgs[n].to_str().expect("utf-8"), format!("a{}", n + 1));
            d.luks_format_integrity(img, ciphers[n], p);
            cs(
                &d,
                &[&["open", "--type", "luks2"][..], &key, &[img, &name]].concat(),
            );
            let sectors = d.sectors(&name);
            let data = pattern(90 + n as u64, (sectors * 512) as usize);
            let mut c = Client::connect(&d.sock(), &name);
            for (j, chunk) in data.chunks(1 << 20).enumerate() {
                c.write((j << 20) as u64, chunk);
            }
            drop(c);
            want.push(md5(&data));
            d.wait_open_count(&name, 0);
            cs(&d, &["close", &name]);
        }
        assert_eq!(d.ok(&["ls"]), "No devices found\n");
    }
    let script = format!(
        r#"{GUEST_HELPERS}
mkdir -p /run/cryptsetup
printf 'correct horse' > /tmp/pw
K="--disable-keyring --key-file /tmp/pw"
n=0
for dev in vda vdb vdc vdd; do
  n=$((n+1))
  if [ $n -ge 3 ]; then
    c=aes-xts-plain64; [ $n = 4 ] && c=aes-xts-random
    cryptsetup luksFormat --batch-mode --type luks2 --integrity hmac-sha256 --cipher $c \
      --pbkdf pbkdf2 --pbkdf-force-iterations 1000 $K /dev/$dev
  fi
  cryptsetup open --type luks2 $K /dev/$dev a$n
  if [ $n -ge 3 ]; then
    dd if=/dev/urandom of=/dev/mapper/a$n bs=65536 2>/dev/null || true
    sync
  fi
  echo "ORACLE a$n-table $(dmsetup table --showkeys a$n)"
  echo "ORACLE a$n-dif $(dmsetup table a${{n}}_dif)"
  echo "ORACLE a$n-md5 $(sum /dev/mapper/a$n)"
  cryptsetup close a$n
done
echo "ORACLE done yes"
"#
    );
    let bins = common::tool_path("cryptsetup");
    let disks: Vec<&Path> = imgs.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(
        &s.0,
        &script,
        &disks,
        &[
            (
                "ORACLE_MODULES",
                &format!("{} {MODULES}", oracle::INTEGRITY_MODULES),
            ),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("ORACLE_BINS", bins.as_str()),
        ],
    );
    let m = markers(&serial);
    assert_eq!(marker(&m, "done"), "yes");
    for (n, w) in want.iter().enumerate() {
        assert_eq!(
            marker(&m, &format!("a{}-md5", n + 1)),
            w,
            "a{}: the kernel reads what dmkit wrote ({})",
            n + 1,
            ciphers[n]
        );
    }
    let d = Daemon::start("crypt-aead-r");
    for (n, img) in imgs.iter().enumerate() {
        let name = format!("a{}", n + 1);
        cs(
            &d,
            &[
                &["open", "--type", "luks2"][..],
                &key,
                &[img.to_str().expect("utf-8"), &name],
            ]
            .concat(),
        );
        for (dev, k) in [(name.clone(), "table"), (format!("{name}_dif"), "dif")] {
            let mine = d.ok(&["table", "--showkeys", &dev]);
            let kernel = marker(&m, &format!("{name}-{k}"));
            let (mut a, mut b): (Vec<&str>, Vec<&str>) = (
                mine.split_whitespace().collect(),
                kernel.split_whitespace().collect(),
            );
            // the device field (crypt's seventh, integrity's fourth)
            let at = if k == "table" { 6 } else { 3 };
            if a.len() > at && b.len() > at {
                a.remove(at);
                b.remove(at);
            }
            assert_eq!(
                a, b,
                "{dev}: cryptsetup's table in dmkit and in the kernel ({})",
                ciphers[n]
            );
        }
        if n >= 2 {
            let sectors = d.sectors(&name);
            let mut c = Client::connect(&d.sock(), &name);
            let mut got = Vec::new();
            for at in (0..sectors * 512).step_by(1 << 20) {
                got.extend(c.read(at, ((sectors * 512 - at).min(1 << 20)) as usize));
            }
            assert_eq!(
                md5(&got),
                marker(&m, &format!("{name}-md5")),
                "{name}: dmkit reads what the kernel wrote ({})",
                ciphers[n]
            );
        }
        d.wait_open_count(&name, 0);
        cs(&d, &["close", &name]);
    }
}
