// The sandbox's KV block manager: a fixed pool of KV blocks (block_size token slots each), a free
// list, per-sequence block tables, reference counts, copy-on-write fork, prefix caching by hashing
// full blocks of token ids chained with their parent's hash, and LRU eviction of cached blocks that
// no sequence holds. Pure C++ (no CUDA): it only decides where KV goes; the caller moves the bytes.
//
// Block states: FREE (ref 0, holds nothing reusable), CACHED-IDLE (ref 0, its full block of KV is
// registered under its prefix hash, evictable, LRU), USED (ref > 0; may also be registered).
// Every operation either completes or throws leaving the state exactly as it was (OutOfBlocks:
// the pool cannot satisfy it; std::invalid_argument: a bad call), so a failure never corrupts.
#pragma once
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace atomflow::sandbox {

// The pool cannot satisfy the request; nothing was changed. Surfaces in Python as OutOfBlocks.
struct OutOfBlocks : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One block the caller must copy on the device (all layers, K and V) before writing into dst.
struct BlockCopy {
  int32_t src;
  int32_t dst;
};

// Where the next token of a sequence goes: slot = block * block_size + offset (a row of the pool
// viewed as [num_blocks * block_size, Hkv, D]), and the copy to run first, if copy-on-write fired.
struct AppendResult {
  int64_t slot;
  bool copied;
  BlockCopy copy;
};

struct BlockStats {
  int64_t prompt_tokens = 0;  // tokens of every allocate() that succeeded
  int64_t cached_tokens = 0;  // of those, found in the prefix cache (not recomputed)
  int64_t evictions = 0;      // cached blocks recycled for new data
  int64_t cow_copies = 0;     // copy-on-write block copies handed to the caller
};

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size, bool prefix_caching = true);

  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  int block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  // Blocks a new allocation may take: free ones plus cached ones no sequence holds.
  int num_available() const { return static_cast<int>(free_.size() + idle_.size()); }
  int num_cached_idle() const { return static_cast<int>(idle_.size()); }
  int num_used() const { return num_blocks() - num_available(); }
  const BlockStats& stats() const { return stats_; }

  // ---- sequences ----
  // New sequence `seq` holding `tokens` (its prompt). Leading full blocks already in the prefix cache
  // are shared instead of allocated; the block holding the last token is never taken from the cache,
  // so at least one token is always left to compute (its logits are needed). Returns the number of
  // cached tokens (a multiple of block_size, < tokens.size()): the caller computes the rest.
  int allocate(int64_t seq, const std::vector<int32_t>& tokens);
  // Blocks allocate(tokens) would take from the pool now (prefix hits excluded), and whether they fit.
  int blocks_needed(const std::vector<int32_t>& tokens) const;
  bool can_allocate(const std::vector<int32_t>& tokens) const;

  // Reserves the slot of one more token of `seq`. Takes a new block when the last one is full, or
  // copies the last block when another sequence shares it (copy-on-write); returns the slot and the copy.
  AppendResult append(int64_t seq, int32_t token);
  // Blocks append(seq) would take from the pool: 0 or 1.
  int append_cost(int64_t seq) const;

  // `child` becomes a copy of `parent` sharing every block (no data moves until one of them writes
  // into a shared, partially filled block).
  void fork(int64_t parent, int64_t child);
  // Drops the sequence; its blocks go back to the pool (registered ones stay findable until evicted).
  void free(int64_t seq);
  // Tokens [0, n) of `seq` now have their KV on the device: its full blocks among them join the
  // prefix cache. (Registering only computed blocks keeps a prefix hit from reading unwritten KV.)
  void commit(int64_t seq, int n);

  // Which of `running` (in priority order, most important first) to preempt, latest first, so that
  // every remaining one can append one token. Changes nothing; throws OutOfBlocks if even the first
  // one alone cannot append.
  std::vector<int64_t> preemption_victims(const std::vector<int64_t>& running) const;

  // ---- queries ----
  bool has(int64_t seq) const { return seqs_.count(seq) != 0; }
  std::vector<int64_t> sequences() const;
  const std::vector<int32_t>& block_table(int64_t seq) const { return get(seq).table; }
  const std::vector<int32_t>& tokens(int64_t seq) const { return get(seq).tokens; }
  int num_tokens(int64_t seq) const { return static_cast<int>(get(seq).tokens.size()); }
  int num_computed(int64_t seq) const { return get(seq).computed; }
  int64_t slot(int64_t seq, int position) const;
  int refcount(int32_t block) const;
  bool is_cached(int32_t block) const;
  // Block tables of `seqs` as one row-major int32 [seqs.size(), max_blocks] array (unused entries 0).
  std::vector<int32_t> table_array(const std::vector<int64_t>& seqs, int max_blocks) const;

  // Verifies every invariant (refcounts = table references, each block in exactly one state, the
  // hash index consistent); throws std::logic_error naming the first violation.
  void check() const;

 private:
  struct Block {
    int ref = 0;
    bool registered = false;        // in the prefix cache under `hash`
    uint64_t hash = 0, parent = 0;  // chained hash of the prefix ending here, and the parent's
    std::vector<int32_t> tokens;    // the block's token ids, compared on every hit (no false hits)
    uint64_t idle_tick = 0;         // when it became CACHED-IDLE (LRU order)
  };
  struct Seq {
    std::vector<int32_t> tokens;
    std::vector<int32_t> table;
    std::vector<uint64_t> hashes;  // chained hashes of the full, computed blocks
    int computed = 0;
  };

  const Seq& get(int64_t seq) const;
  Seq& get(int64_t seq);
  std::vector<int32_t> prefix_hits(const std::vector<int32_t>& tokens) const;
  int32_t take_block();         // throws OutOfBlocks with nothing changed
  void retain(int32_t block);   // ref++ (takes a CACHED-IDLE block out of the LRU)
  void release(int32_t block);  // ref--, to FREE or CACHED-IDLE at 0
  void unregister(int32_t block);

  int block_size_;
  bool prefix_caching_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;                    // FREE blocks (a stack)
  std::set<std::pair<uint64_t, int32_t>> idle_;  // CACHED-IDLE blocks by idle_tick (LRU first)
  std::unordered_map<uint64_t, int32_t> index_;  // prefix hash -> registered block
  std::unordered_map<int64_t, Seq> seqs_;
  uint64_t tick_ = 0;
  BlockStats stats_;
};

// The chained hash of one full block: mixes the parent's hash with the block's token ids.
uint64_t block_hash(uint64_t parent, const int32_t* tokens, int n);

}  // namespace atomflow::sandbox
