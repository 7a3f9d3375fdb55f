//! Property test: any message any client sends to any device is answered or
//! refused, never a panic. A panic on the control path ends the daemon (see
//! RELIABILITY.md, Panics), so one word a parser slices wrongly stops every
//! device: `@stats_create - 1 1 histogramé1` did, until 2026-12-01. Devices of
//! most targets live in one in-process registry; each case sends a few messages
//! built from the targets' own verbs, numbers and arbitrary text (non-ASCII
//! included), then reads every table and status line.

use dmkit::mapper::{config::Config, Registry};
use proptest::prelude::*;
use std::sync::OnceLock;

const DEVICES: &[&str] = &[
    "z", "lin", "pool", "thin", "wc", "cr", "lw", "cache", "era", "flakey", "delay", "raid", "integ",
];

/// Every word a target's messages start with or take, and the core's.
const VERBS: &[&str] = &[
    "create_thin",
    "create_snap",
    "delete",
    "set_transaction_id",
    "reserve_metadata_snap",
    "release_metadata_snap",
    "flush",
    "flush_on_suspend",
    "cleaner",
    "clear_stats",
    "key",
    "set",
    "wipe",
    "mark",
    "checkpoint",
    "take_metadata_snap",
    "drop_metadata_snap",
    "migration_threshold",
    "sequential_threshold",
    "random_threshold",
    "invalidate_cblocks",
    "corrupt_bio_byte",
    "idle",
    "frozen",
    "resync",
    "recover",
    "check",
    "repair",
    "@stats_create",
    "@stats_print",
    "@stats_print_clear",
    "@stats_list",
    "@stats_delete",
    "@stats_clear",
    "@stats_set_aux",
    "@cancel_deferred_remove",
    "histogram:1,2",
    "precise_timestamps",
    "r",
    "w",
    "-",
    "/4",
];

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("dmkit-message-props-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let file = |name: &str, bytes: u64| {
            let p = dir.join(name);
            std::fs::File::create(&p)
                .and_then(|f| f.set_len(bytes))
                .expect("scratch file");
            p.display().to_string()
        };
        let reg = Registry::new(
            Config {
                direct_io: false,
                restart_logs: None,
                ..Config::default()
            },
            dmkit::targets::types(),
        );
        let tables = vec![
            ("z", "0 131072 zero".to_string()),
            ("lin", format!("0 8192 linear {} 0", file("lin", 4 << 20))),
            (
                "pool",
                format!(
                    "0 32768 thin-pool {} {} 128 0 1 error_if_no_space",
                    file("meta", 4 << 20),
                    file("data", 16 << 20)
                ),
            ),
            (
                "wc",
                format!(
                    "0 8192 writecache s {} {} 4096 0",
                    file("origin", 4 << 20),
                    file("wcache", 1 << 20)
                ),
            ),
            (
                "cr",
                format!(
                    "0 8192 crypt aes-xts-plain64 {} 0 {} 0",
                    "0123456789abcdef".repeat(4),
                    file("crypt", 4 << 20)
                ),
            ),
            (
                "lw",
                format!(
                    "0 8192 log-writes {} {}",
                    file("lwdata", 4 << 20),
                    file("lwlog", 1 << 20)
                ),
            ),
            (
                "cache",
                format!(
                    "0 8192 cache {} {} {} 64 1 writeback default 0",
                    file("cmeta", 2 << 20),
                    file("cblocks", 1 << 20),
                    file("corigin", 4 << 20)
                ),
            ),
            (
                "era",
                format!(
                    "0 8192 era {} {} 32",
                    file("emeta", 2 << 20),
                    file("eorigin", 4 << 20)
                ),
            ),
            (
                "flakey",
                format!("0 8192 flakey {} 0 1 1", file("flakey", 4 << 20)),
            ),
            ("delay", format!("0 8192 delay {} 0 0", file("delay", 4 << 20))),
            (
                "raid",
                format!(
                    "0 8192 raid raid1 3 0 region_size 128 2 {} {} {} {}",
                    file("rm0", 1 << 20),
                    file("rd0", 4 << 20),
                    file("rm1", 1 << 20),
                    file("rd1", 4 << 20)
                ),
            ),
            (
                "integ",
                format!(
                    "0 8192 integrity {} 0 4 J 1 internal_hash:crc32c",
                    file("integ", 8 << 20)
                ),
            ),
        ];
        for (name, table) in tables {
            reg.create(name, Some(&table), false, None)
                .unwrap_or_else(|e| panic!("{name}: {table}: {e}"));
        }
        reg.message("pool", 0, &["create_thin 0".to_string()])
            .expect("create_thin");
        reg.create("thin", Some("0 16384 thin /dev/mapper/pool 0"), false, None)
            .expect("thin");
        reg
    })
}

fn word() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(VERBS).prop_map(str::to_string),
        3 => "[0-9]{1,3}|[0-9]{1,20}|-?[0-9]{1,4}\\+[0-9]{1,4}",
        2 => "(histogram:?|/|key|@stats_)[:,0-9a-fé€]{0,12}",
        2 => "\\PC{0,16}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn any_message_to_any_device_is_answered_without_a_panic(
        msgs in proptest::collection::vec(
            (proptest::sample::select(DEVICES), 0u64..3, proptest::collection::vec(word(), 0..7)),
            1..5,
        ),
    ) {
        let reg = registry();
        for (dev, sector, words) in msgs {
            let _ = reg.message(dev, sector, &words);
        }
        let _ = reg.table_lines(None, true, false, false);
        let _ = reg.table_lines(None, false, false, false);
    }
}
