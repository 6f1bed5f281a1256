// The KV block manager (block_manager.h). Each mutating call checks everything that can fail
// before it changes anything, so an exception always leaves the previous state.
#include "block_manager.h"

#include <algorithm>

namespace atomflow::sandbox {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

[[noreturn]] void bad_call(const std::string& msg) { throw std::invalid_argument("BlockManager: " + msg); }

}  // namespace

// 64 bits, chained: a false prefix hit would need two different prefixes with equal hashes AND
// equal block tokens (every hit also compares the tokens and the parent hash).
uint64_t block_hash(uint64_t parent, const int32_t* tokens, int n) {
  uint64_t h = splitmix64(parent ^ 0xA0761D6478BD642Full) ^ static_cast<uint64_t>(n);
  for (int i = 0; i < n; ++i) h = splitmix64(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

BlockManager::BlockManager(int num_blocks, int block_size, bool prefix_caching)
    : block_size_(block_size), prefix_caching_(prefix_caching) {
  if (num_blocks < 1) bad_call("num_blocks must be >= 1, got " + std::to_string(num_blocks));
  if (block_size < 1) bad_call("block_size must be >= 1, got " + std::to_string(block_size));
  blocks_.resize(static_cast<size_t>(num_blocks));
  free_.reserve(blocks_.size());
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 handed out first
}

const BlockManager::Seq& BlockManager::get(int64_t seq) const {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) bad_call("no sequence " + std::to_string(seq));
  return it->second;
}
BlockManager::Seq& BlockManager::get(int64_t seq) {
  return const_cast<Seq&>(static_cast<const BlockManager*>(this)->get(seq));
}

// ---- pool ----

int32_t BlockManager::take_block() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!idle_.empty()) {  // recycle the least recently used cached block
    b = idle_.begin()->second;
    idle_.erase(idle_.begin());
    unregister(b);
    ++stats_.evictions;
  } else {
    throw OutOfBlocks("out of KV blocks: all " + std::to_string(blocks_.size()) + " are in use");
  }
  blocks_[static_cast<size_t>(b)].ref = 1;
  return b;
}

void BlockManager::retain(int32_t b) {
  Block& blk = blocks_[static_cast<size_t>(b)];
  if (blk.ref == 0) idle_.erase({blk.idle_tick, b});  // only registered blocks are ever retained at 0
  ++blk.ref;
}

void BlockManager::release(int32_t b) {
  Block& blk = blocks_[static_cast<size_t>(b)];
  if (--blk.ref > 0) return;
  if (blk.registered) {
    blk.idle_tick = ++tick_;
    idle_.insert({blk.idle_tick, b});
  } else {
    free_.push_back(b);
  }
}

void BlockManager::unregister(int32_t b) {
  Block& blk = blocks_[static_cast<size_t>(b)];
  const auto it = index_.find(blk.hash);
  if (it != index_.end() && it->second == b) index_.erase(it);
  blk.registered = false;
  blk.hash = blk.parent = 0;
  blk.tokens.clear();
}

// ---- sequences ----

// Leading full blocks of `tokens` found in the cache, stopping at the first miss; only blocks
// entirely before the last token qualify (that token must be computed for its logits).
std::vector<int32_t> BlockManager::prefix_hits(const std::vector<int32_t>& tokens) const {
  std::vector<int32_t> hits;
  if (!prefix_caching_ || tokens.empty()) return hits;
  const size_t n_full = (tokens.size() - 1) / static_cast<size_t>(block_size_);
  uint64_t parent = 0;
  for (size_t i = 0; i < n_full; ++i) {
    const int32_t* t = tokens.data() + i * block_size_;
    const uint64_t h = block_hash(parent, t, block_size_);
    const auto it = index_.find(h);
    if (it == index_.end()) break;
    const Block& blk = blocks_[static_cast<size_t>(it->second)];
    if (blk.parent != parent || !std::equal(blk.tokens.begin(), blk.tokens.end(), t)) break;
    hits.push_back(it->second);
    parent = h;
  }
  return hits;
}

int BlockManager::blocks_needed(const std::vector<int32_t>& tokens) const {
  const int n_blocks = static_cast<int>((tokens.size() + block_size_ - 1) / block_size_);
  return n_blocks - static_cast<int>(prefix_hits(tokens).size());
}

bool BlockManager::can_allocate(const std::vector<int32_t>& tokens) const {
  const std::vector<int32_t> hits = prefix_hits(tokens);
  int idle_hits = 0;
  for (int32_t b : hits) idle_hits += blocks_[static_cast<size_t>(b)].ref == 0;
  const int n_blocks = static_cast<int>((tokens.size() + block_size_ - 1) / block_size_);
  return n_blocks - static_cast<int>(hits.size()) <= num_available() - idle_hits;
}

int BlockManager::allocate(int64_t seq, const std::vector<int32_t>& tokens) {
  if (has(seq)) bad_call("sequence " + std::to_string(seq) + " already exists");
  if (tokens.empty()) bad_call("allocate: a sequence needs at least one token");
  const std::vector<int32_t> hits = prefix_hits(tokens);
  int idle_hits = 0;  // hits no sequence holds yet: retaining them removes them from the available pool
  for (int32_t b : hits) idle_hits += blocks_[static_cast<size_t>(b)].ref == 0;
  const int n_blocks = static_cast<int>((tokens.size() + block_size_ - 1) / block_size_);
  const int need = n_blocks - static_cast<int>(hits.size());
  if (need > num_available() - idle_hits)
    throw OutOfBlocks("out of KV blocks: a prompt of " + std::to_string(tokens.size()) + " tokens needs " +
                      std::to_string(need) + " new blocks, " + std::to_string(num_available() - idle_hits) +
                      " available");
  Seq s;
  s.tokens = tokens;
  s.table.reserve(static_cast<size_t>(n_blocks));
  uint64_t parent = 0;
  for (int32_t b : hits) {  // retained before any take_block(), so none of them can be evicted below
    retain(b);
    s.table.push_back(b);
    parent = blocks_[static_cast<size_t>(b)].hash;
    s.hashes.push_back(parent);
  }
  for (int i = 0; i < need; ++i) s.table.push_back(take_block());
  s.computed = static_cast<int>(hits.size()) * block_size_;
  seqs_.emplace(seq, std::move(s));
  stats_.prompt_tokens += static_cast<int64_t>(tokens.size());
  stats_.cached_tokens += static_cast<int64_t>(hits.size()) * block_size_;
  return static_cast<int>(hits.size()) * block_size_;
}

int BlockManager::append_cost(int64_t seq) const {
  const Seq& s = get(seq);
  if (s.tokens.size() % block_size_ == 0) return 1;
  return blocks_[static_cast<size_t>(s.table.back())].ref > 1 ? 1 : 0;
}

AppendResult BlockManager::append(int64_t seq, int32_t token) {
  Seq& s = get(seq);
  const int offset = static_cast<int>(s.tokens.size() % block_size_);
  AppendResult r{0, false, {-1, -1}};
  if (offset == 0) {
    s.table.push_back(take_block());  // take_block() throws before anything changed
  } else {
    const int32_t last = s.table.back();
    if (blocks_[static_cast<size_t>(last)].ref > 1) {  // shared and partially filled: copy on write
      const int32_t fresh = take_block();
      release(last);  // stays >= 1: the other holders keep it
      s.table.back() = fresh;
      r.copied = true;
      r.copy = {last, fresh};
      ++stats_.cow_copies;
    }
  }
  r.slot = static_cast<int64_t>(s.table.back()) * block_size_ + offset;
  s.tokens.push_back(token);
  return r;
}

void BlockManager::fork(int64_t parent, int64_t child) {
  if (has(child)) bad_call("fork: sequence " + std::to_string(child) + " already exists");
  Seq copy = get(parent);
  for (int32_t b : copy.table) retain(b);
  seqs_.emplace(child, std::move(copy));
}

void BlockManager::free(int64_t seq) {
  const Seq& s = get(seq);
  // Tail first: the LRU then evicts a prefix's last blocks before its first ones (a lost head
  // would make the rest unreachable anyway).
  for (auto it = s.table.rbegin(); it != s.table.rend(); ++it) release(*it);
  seqs_.erase(seq);
}

void BlockManager::commit(int64_t seq, int n) {
  Seq& s = get(seq);
  if (n < 0 || n > static_cast<int>(s.tokens.size()))
    bad_call("commit(" + std::to_string(n) + "): sequence " + std::to_string(seq) + " has " +
             std::to_string(s.tokens.size()) + " tokens");
  s.computed = std::max(s.computed, n);
  while (static_cast<int>(s.hashes.size() + 1) * block_size_ <= s.computed) {
    const size_t i = s.hashes.size();
    const uint64_t parent = i ? s.hashes[i - 1] : 0;
    const int32_t* t = s.tokens.data() + i * block_size_;
    const uint64_t h = block_hash(parent, t, block_size_);
    s.hashes.push_back(h);
    if (!prefix_caching_) continue;
    Block& blk = blocks_[static_cast<size_t>(s.table[i])];
    // Already registered (shared through fork or a hit), or the same prefix already cached in
    // another block (computed twice concurrently): then this copy simply is not indexed.
    if (blk.registered || index_.count(h)) continue;
    blk.registered = true;
    blk.hash = h;
    blk.parent = parent;
    blk.tokens.assign(t, t + block_size_);
    index_[h] = s.table[i];
  }
}

std::vector<int64_t> BlockManager::preemption_victims(const std::vector<int64_t>& running) const {
  std::unordered_map<int32_t, int> dropped;  // references the victims so far would release
  auto ref = [&](int32_t b) {
    const auto it = dropped.find(b);
    return blocks_[static_cast<size_t>(b)].ref - (it == dropped.end() ? 0 : it->second);
  };
  auto cost = [&](int64_t seq) {
    const Seq& s = get(seq);
    if (s.tokens.size() % block_size_ == 0) return 1;
    return ref(s.table.back()) > 1 ? 1 : 0;
  };
  std::vector<int64_t> left = running, victims;
  {
    std::vector<int64_t> sorted = running;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) bad_call("preemption_victims: duplicate ids");
    for (int64_t s : running) get(s);  // throws on an unknown id
  }
  int available = num_available();
  while (!left.empty()) {
    int need = 0;
    for (int64_t s : left) need += cost(s);
    if (need <= available) return victims;
    if (left.size() == 1)
      throw OutOfBlocks("out of KV blocks: sequence " + std::to_string(left[0]) + " cannot append even alone");
    const int64_t v = left.back();
    left.pop_back();
    for (int32_t b : get(v).table) {
      ++dropped[b];
      if (ref(b) == 0) ++available;
    }
    victims.push_back(v);
  }
  return victims;
}

// ---- queries ----

std::vector<int64_t> BlockManager::sequences() const {
  std::vector<int64_t> out;
  out.reserve(seqs_.size());
  for (const auto& kv : seqs_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

int64_t BlockManager::slot(int64_t seq, int position) const {
  const Seq& s = get(seq);
  if (position < 0 || position >= static_cast<int>(s.tokens.size()))
    bad_call("slot: position " + std::to_string(position) + " outside sequence " + std::to_string(seq));
  return static_cast<int64_t>(s.table[static_cast<size_t>(position / block_size_)]) * block_size_ +
         position % block_size_;
}

int BlockManager::refcount(int32_t block) const {
  if (block < 0 || block >= num_blocks()) bad_call("no block " + std::to_string(block));
  return blocks_[static_cast<size_t>(block)].ref;
}

bool BlockManager::is_cached(int32_t block) const {
  if (block < 0 || block >= num_blocks()) bad_call("no block " + std::to_string(block));
  return blocks_[static_cast<size_t>(block)].registered;
}

std::vector<int32_t> BlockManager::table_array(const std::vector<int64_t>& seqs, int max_blocks) const {
  if (max_blocks < 1) bad_call("table_array: max_blocks must be >= 1");
  std::vector<int32_t> out(seqs.size() * static_cast<size_t>(max_blocks), 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const std::vector<int32_t>& t = get(seqs[i]).table;
    if (static_cast<int>(t.size()) > max_blocks)
      bad_call("table_array: sequence " + std::to_string(seqs[i]) + " has " + std::to_string(t.size()) +
               " blocks, more than max_blocks " + std::to_string(max_blocks));
    std::copy(t.begin(), t.end(), out.begin() + static_cast<std::ptrdiff_t>(i * max_blocks));
  }
  return out;
}

void BlockManager::check() const {
  auto fail = [](const std::string& msg) { throw std::logic_error("BlockManager invariant: " + msg); };
  const size_t n = blocks_.size();
  std::vector<int> refs(n, 0);
  for (const auto& [id, s] : seqs_) {
    const size_t want = (s.tokens.size() + block_size_ - 1) / block_size_;
    if (s.table.size() != want) fail("sequence " + std::to_string(id) + " has a table of the wrong length");
    if (s.computed < 0 || s.computed > static_cast<int>(s.tokens.size())) fail("computed out of range");
    if (s.hashes.size() != static_cast<size_t>(s.computed / block_size_)) fail("hash chain length");
    for (int32_t b : s.table) {
      if (b < 0 || static_cast<size_t>(b) >= n) fail("table entry out of range");
      ++refs[static_cast<size_t>(b)];
    }
  }
  std::vector<char> in_free(n, 0), in_idle(n, 0);
  for (int32_t b : free_) {
    if (b < 0 || static_cast<size_t>(b) >= n || in_free[static_cast<size_t>(b)]) fail("free list corrupt");
    in_free[static_cast<size_t>(b)] = 1;
  }
  for (const auto& [tick, b] : idle_) {
    if (b < 0 || static_cast<size_t>(b) >= n || in_idle[static_cast<size_t>(b)]) fail("idle list corrupt");
    if (blocks_[static_cast<size_t>(b)].idle_tick != tick) fail("idle tick mismatch");
    in_idle[static_cast<size_t>(b)] = 1;
  }
  size_t registered = 0;
  for (size_t b = 0; b < n; ++b) {
    const Block& blk = blocks_[b];
    const std::string name = "block " + std::to_string(b);
    if (blk.ref != refs[b])
      fail(name + ": refcount " + std::to_string(blk.ref) + " but " + std::to_string(refs[b]) + " tables hold it");
    const bool want_free = blk.ref == 0 && !blk.registered, want_idle = blk.ref == 0 && blk.registered;
    if (static_cast<bool>(in_free[b]) != want_free) fail(name + ": free-list membership wrong");
    if (static_cast<bool>(in_idle[b]) != want_idle) fail(name + ": idle-list membership wrong");
    if (blk.registered) {
      ++registered;
      const auto it = index_.find(blk.hash);
      if (it == index_.end() || it->second != static_cast<int32_t>(b)) fail(name + ": registered but not indexed");
      if (blk.tokens.size() != static_cast<size_t>(block_size_)) fail(name + ": registered without its tokens");
    }
  }
  if (registered != index_.size()) fail("index holds unregistered blocks");
}

}  // namespace atomflow::sandbox
